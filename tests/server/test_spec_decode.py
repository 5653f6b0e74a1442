"""The decode scheduler's speculative loop, driven through a worker-group double whose target and
draft are known sequences, so every verify step's outcome is predictable: the exact number of
verify forwards, stop tokens and max_new_tokens landing inside an accepted run (nothing emitted
past them), the tokens streamed, and pages back to full. The real model and transfer paths are
tested end to end in tests/e2e/test_dflash.py."""

from __future__ import annotations

import torch

from glm53.models.spec_state import SpecOutput
from glm53.server.config_parse import parse_config
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.engine.group import WorkerGroup
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from glm53.support.ports import free_ports

V = 50
PROMPT = [3, 4, 5, 6, 7]


def target_token(pos: int) -> int:
    """The target's greedy token at position `pos` (predicted from everything before it)."""
    return 10 + (pos * 7) % 31


class KnownWorkers(WorkerGroup):
    """Greedy target = `target_token`; the draft proposes `propose(pos)` for position pos."""

    def __init__(self, block_size: int, propose):
        self.cfg = type("Cfg", (), {"vocab_size": V, "max_position_embeddings": 4096})()
        self.num_pages, self.page_size, self.bytes_per_page = 64, 16, 1
        self.draft_bytes_per_page = 0
        self.block_size, self.sends_draft_kv = block_size, False
        self.propose, self.blocks = propose, []

    def spec_step(self, blocks):
        self.blocks.extend(blocks)
        drafts, logits = [], []
        for b in blocks:
            d = [self.propose(b.start_pos + 1 + i) for i in range(b.block_size - 1)]
            rows = torch.full((b.block_size, V), -10.0)
            for i in range(b.block_size):
                rows[i, target_token(b.start_pos + 1 + i)] = 10.0
            drafts.append(d)
            logits.append(rows)
        return SpecOutput(drafts, logits)

    def forward_microbatches(self, microbatches):
        raise AssertionError("speculative decoding verifies through spec_step only")

    def create_senders(self, room, decode_instance):
        raise AssertionError("no transfers in these tests")

    def create_receivers(self, room, bootstrap_address, dst_pages):
        raise AssertionError("no transfers in these tests")

    def copy_pages(self, src, dst):
        raise AssertionError("these tests ask for one choice per request")

    def close(self):
        pass


def scheduler(block_size: int, propose, **spec) -> tuple[DecodeScheduler, list]:
    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": "/unused"},
        "speculative": {"algorithm": "DFLASH", "draft_model_path": "/unused", **spec},
        "defaults": {"device": "cpu", "page_size": 16, "num_pages": 64, "stream_interval": 1000},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })
    sched = DecodeScheduler(cfg, cfg.decode[0], workers=KnownWorkers(block_size, propose))
    sent = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    return sched, sent


def adopt(sched: DecodeScheduler, max_new: int, stop_ids=(), first_token: int | None = None, rid: str = "r",
          room: int = 1) -> DecodeRequest:
    """A request whose first token prefill sampled, running on `sched`."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=list(stop_ids))
    req = GenerateRequest(spec=RequestSpec(rid, PROMPT, params, []), room=room, generation=0,
                          prefill=PeerInfo("p0", "prefill", "h", 1, 2), decode=PeerInfo("d0", "decode", "h", 3, None),
                          reply_to="tcp://unused:1")
    r = DecodeRequest(req, arrived=0.0, pages=sched.allocator.alloc(sched.workers.pages_needed(len(PROMPT) + max_new)))
    first = target_token(len(PROMPT)) if first_token is None else first_token
    sched._commit(r, [first], first=True)
    return r


def run(sched: DecodeScheduler, sent: list, max_new: int, stop_ids=(), first_token: int | None = None):
    """Adopt one request whose first token prefill sampled, decode it to the end."""
    adopt(sched, max_new, stop_ids, first_token)
    steps = 0
    while sched.running:
        sched._decode()
        steps += 1
        assert steps < 100
    out = [t for ev in sent for t in ev.token_ids]
    return out, sum(len(ev.spec_accept) for ev in sent), sent[-1]


def greedy(max_new: int) -> list[int]:
    return [target_token(len(PROMPT) + i) for i in range(max_new)]


def test_perfect_draft_commits_whole_blocks():
    sched, sent = scheduler(4, target_token)
    try:
        out, verify_ct, last = run(sched, sent, max_new=11)
        # 1 token from prefill, then blocks of 4 commit 4 each: 4 + 4 + 2 (the last block shrinks
        # to the 2 tokens left, so nothing is verified past max_new_tokens).
        assert out == greedy(11) and verify_ct == 3 and last.finish_reason == "length"
        assert [b.block_size for b in sched.workers.blocks] == [4, 4, 2]
        assert [b.start_pos for b in sched.workers.blocks] == [5, 9, 13]
        assert sched.allocator.num_free == sched.allocator.num_pages
    finally:
        sched.close()


def test_constant_draft_commits_one_token_per_verify():
    sched, sent = scheduler(16, lambda pos: 0)  # 0 is never the target's token
    try:
        out, verify_ct, _ = run(sched, sent, max_new=9)
        assert out == greedy(9) and verify_ct == 8
    finally:
        sched.close()


def test_stop_token_inside_an_accepted_run_ends_it_there():
    sched, sent = scheduler(8, target_token)
    try:
        want = greedy(30)
        stop = want[5]  # committed in the middle of the first accepted block (positions 1..8)
        assert stop not in want[:5]
        out, verify_ct, last = run(sched, sent, max_new=30, stop_ids=[stop])
        assert out == want[:6] and verify_ct == 1
        assert last.finish_reason == "stop" and last.matched_stop == stop
        assert sched.allocator.num_free == sched.allocator.num_pages
    finally:
        sched.close()


def test_partly_right_draft():
    # Right on even positions only: each verify accepts up to the first odd position.
    sched, sent = scheduler(4, lambda pos: target_token(pos) if pos % 2 == 0 else 1)
    try:
        out, verify_ct, _ = run(sched, sent, max_new=12)
        assert out == greedy(12)
        accepted = [n for ev in sent for n in ev.spec_accept]
        assert sum(accepted) == 11 and all(1 <= n <= 2 for n in accepted) and verify_ct == len(accepted)
    finally:
        sched.close()


def test_batches_above_disable_by_batch_size_verify_one_token_undrafted():
    # speculative.disable_by_batch_size 1: while two requests run, each step verifies blocks of
    # one (no drafting); once one has finished, the other drafts whole blocks again
    sched, sent = scheduler(4, target_token, disable_by_batch_size=1)
    try:
        adopt(sched, max_new=4, rid="a", room=1)
        adopt(sched, max_new=11, rid="b", room=2)
        steps = 0
        while sched.running:
            sched._decode()
            steps += 1
            assert steps < 100
        sizes = [b.block_size for b in sched.workers.blocks]
        # three steps of two one-token blocks take a to 4 tokens and b to 4; b then commits
        # 4 + 3 in blocks of 4 and 3 (its last block shrinks to what max_new_tokens leaves)
        assert sizes == [1, 1, 1, 1, 1, 1, 4, 3], sizes
        for room, n in ((1, 4), (2, 11)):
            assert [t for ev in sent if ev.room == room for t in ev.token_ids] == greedy(n)
        assert sched.allocator.num_free == sched.allocator.num_pages
    finally:
        sched.close()

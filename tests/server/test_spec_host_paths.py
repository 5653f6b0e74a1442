"""The decode loop's host shortcuts for speculative steps, against the paths they stand for, on
fresh random inputs: `greedy_prefix` (a greedy request accepting from the step's argmaxes)
against `accept` reading the logits; `_commit` deciding the end by slices (no stop strings, no
logprobs) against its token-by-token `_finish` path; and whole decodes whose steps hand the
argmaxes back against the same steps without them."""

from __future__ import annotations

import random

import torch

from glm53.models.spec_state import SpecOutput
from glm53.server.config_parse import parse_config
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.engine.group import WorkerGroup
from glm53.server.engine.spec import accept, greedy_prefix
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from glm53.support.ports import free_ports

V = 40


class RandomWorkers(WorkerGroup):
    """A target whose greedy token at a position is a fixed random function of it; drafts right
    with probability `hit` per token; `with_argmax`: the output carries each row's argmax."""

    def __init__(self, block_size: int, seed: int, with_argmax: bool, hit: float = 0.7):
        self.cfg = type("Cfg", (), {"vocab_size": V, "max_position_embeddings": 4096})()
        self.num_pages, self.page_size, self.bytes_per_page = 256, 16, 1
        self.draft_bytes_per_page = 0
        self.block_size, self.sends_draft_kv = block_size, False
        self.seed, self.with_argmax, self.hit = seed, with_argmax, hit

    def target(self, key: int, pos: int) -> int:
        return random.Random(self.seed * 1_000_003 + key * 10_007 + pos).randrange(V)

    def spec_step(self, blocks):
        drafts, logits, greedy = [], [], []
        for b in blocks:
            rng = random.Random(self.seed + 7919 * b.start_pos + b.key)
            want = [self.target(b.key, b.start_pos + 1 + i) for i in range(b.block_size)]
            d = [t if rng.random() < self.hit else rng.randrange(V) for t in want[:-1]]
            rows = torch.randn(b.block_size, V)
            rows[torch.arange(b.block_size), torch.tensor(want)] = 50.0
            drafts.append(d)
            logits.append(rows)
            greedy.append(rows.argmax(dim=-1).tolist())
        return SpecOutput(drafts, logits, greedy if self.with_argmax else None)

    def forward_microbatches(self, microbatches):
        raise AssertionError("speculative decoding verifies through spec_step only")

    def create_senders(self, room, decode_instance):
        raise AssertionError("no transfers")

    def create_receivers(self, room, bootstrap_address, dst_pages):
        raise AssertionError("no transfers")

    def copy_pages(self, src, dst):
        raise AssertionError("one choice per request")

    def close(self):
        pass


def make(workers: WorkerGroup) -> tuple[DecodeScheduler, list]:
    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": "/unused"},
        "speculative": {"algorithm": "DFLASH", "draft_model_path": "/unused"},
        "defaults": {"device": "cpu", "page_size": 16, "num_pages": 256, "stream_interval": 5},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })
    sched = DecodeScheduler(cfg, cfg.decode[0], workers=workers)
    sent: list = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    return sched, sent


def request(sched: DecodeScheduler, room: int, prompt: list[int], max_new: int, stops: list[int]) -> DecodeRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=stops)
    req = GenerateRequest(spec=RequestSpec(f"r{room}", prompt, params, [V - 1]), room=room, generation=0,
                          prefill=PeerInfo("p0", "prefill", "h", 1, 2), decode=PeerInfo("d0", "decode", "h", 3, None),
                          reply_to="tcp://unused:1")
    pages = sched.allocator.alloc(sched.workers.pages_needed(len(prompt) + max_new))
    return DecodeRequest(req, arrived=0.0, pages=pages)


def reference_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """Greedy verification spelled out: drafts while they equal the target's token, then its token."""
    out = []
    for d, t in zip(drafts, target):
        if d != t:
            break
        out.append(d)
    return out + [target[len(out)]]


def test_greedy_prefix_is_greedy_accept():
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    for _ in range(300):
        n = int(torch.randint(0, 16, (), generator=g))
        logits = torch.randn(n + 1, V, generator=g)
        target = logits.argmax(dim=-1).tolist()
        # Drafts right up to a random point, then random.
        cut = int(torch.randint(0, n + 1, (), generator=g))
        drafts = target[:cut] + torch.randint(0, V, (n - cut,), generator=g).tolist()
        want = reference_greedy(drafts, target)
        assert accept(drafts, logits, greedy, first_step=1) == want
        assert greedy_prefix(drafts, target) == want
        assert accept(drafts, logits, greedy, first_step=1, argmax=target) == want


def test_commit_by_slices_is_token_by_token():
    rng = random.Random(2)
    sched, sent = make(RandomWorkers(8, 0, True))
    try:
        for case in range(400):
            max_new = rng.randrange(0, 12)
            stops = rng.sample(range(V), rng.randrange(0, 4))
            prefix = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
            toks = [rng.randrange(V) for _ in range(rng.randrange(1, 10))]
            if stops and rng.random() < 0.5:
                toks[rng.randrange(len(toks))] = rng.choice(stops)
            results = []
            for logprobs in (False, True):  # with logprobs _commit takes the token-by-token path
                sent.clear()
                r = request(sched, 2 * case + logprobs, [1, 2, 3], max_new, stops)
                r.output, r.finished = list(prefix), False
                sched.running.append(r)
                extra = ([0.0] * len(toks), [[]] * len(toks)) if logprobs else ()
                n = sched._commit(r, toks, *extra, verified=True)
                ev = [(e.token_ids, e.finish_reason, e.matched_stop, e.spec_accept) for e in sent]
                results.append((n, list(r.output), r.finished, ev, r in sched.running))
                if r in sched.running:
                    sched._release(r)
            assert results[0] == results[1], (max_new, stops, prefix, toks)
        assert sched.allocator.num_free == sched.allocator.num_pages
    finally:
        sched.close()


def decode(block: int, seed: int, with_argmax: bool) -> list:
    rng = random.Random(seed)
    workers = RandomWorkers(block, seed, with_argmax)
    sched, sent = make(workers)
    try:
        reqs = []
        for room in range(6):
            max_new = rng.randrange(1, 40)
            r = request(sched, room, [rng.randrange(V) for _ in range(rng.randrange(1, 30))], max_new,
                        rng.sample(range(V), rng.randrange(0, 3)))
            sched._commit(r, [rng.randrange(V)], first=True)
            reqs.append(r)
        while sched.running:
            sched._decode()
        assert sched.allocator.num_free == sched.allocator.num_pages
        for r in reqs:  # every token after prefill's is the target's
            assert r.output[1:] == [workers.target(r.spec_key, r.prompt_len + j) for j in range(1, len(r.output))]
        return [(e.room, e.token_ids, e.finish_reason, e.matched_stop, e.spec_accept, e.completion_tokens)
                for e in sent]
    finally:
        sched.close()


def test_decodes_from_step_argmaxes_match_reading_the_logits():
    for seed in range(12):
        for block in (2, 4, 8):
            assert decode(block, seed, True) == decode(block, seed, False)

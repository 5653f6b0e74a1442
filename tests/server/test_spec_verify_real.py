"""The speculative loop on the real model (embedded tiny GLM-5 + a random DFlash draft, one
in-process rank), with the draft's proposals replaced by known sequences so that long runs are
accepted: the verify forward's KV writes, the accepted prefixes and the bonus tokens must give
exactly plain greedy decoding, with the predicted number of verify steps. (A random draft is
almost never right, so without this the multi-token paths would go untested on a real model.)"""

from __future__ import annotations

import pytest
import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk, write_random_draft
from glm53.models.dspark import BlockChoice
from glm53.server.config_parse import parse_config
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.offline import greedy_generate
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from glm53.server.tokenizer import Tokenizer
from glm53.support.ports import free_ports

MAX_NEW = 14
B = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model_dir):
    draft = write_random_draft(tmp_path_factory.mktemp("draft"), model_dir, seed=3, n_layers=2, block_size=B)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (9, 90)]  # 90 > index_topk
    runner = ModelRunner.from_dir(model_dir, page_size=16, num_pages=64, progress=False)
    want = greedy_generate(runner, PageAllocator(64), prompts, MAX_NEW, ignore_eos=True)
    return draft, prompts, want


def scheduler(model_dir, draft) -> DecodeScheduler:
    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": str(model_dir)},
        "speculative": {"algorithm": "DFLASH", "draft_model_path": str(draft)},
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": 16, "num_pages": 64,
                     "stream_interval": 1000},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })
    return DecodeScheduler(cfg, cfg.decode[0])


def known_proposals(prompts, want, right_every):
    """A `draft_block` that drafts the greedy continuation, wrong at every `right_every`-th slot."""
    truth = {len(p): w for p, w in zip(prompts, want)}  # by prompt length: output position -> token

    def propose(blocks):
        rows = []
        for b in blocks:
            plen = max(n for n in truth if n <= b.start_pos)  # the prompt of this block
            out = truth[plen]
            row = []
            for i in range(b.block_size - 1):
                j = b.start_pos + 1 + i - plen  # output index this draft slot predicts
                ok = right_every == 1 or (i + 1) % right_every != 0
                row.append(out[j] if ok and j < len(out) else 0)
            rows.append(row)
        tokens = torch.tensor(rows)
        return BlockChoice(tokens, torch.full((len(rows),), tokens.shape[1]))

    return propose


def adopt(sched: DecodeScheduler, room: int, prompt: list[int], params: SamplingParams) -> DecodeRequest:
    """What prefill and the transfer would have done: the prompt's KV and draft context in the
    request's pages, the first token committed."""
    req = GenerateRequest(spec=RequestSpec(f"r{room}", prompt, params, []), room=room, generation=0,
                          prefill=PeerInfo("p0", "prefill", "h", 1, 2),
                          decode=PeerInfo("d0", "decode", "h", 3, None), reply_to="tcp://unused:1")
    r = DecodeRequest(req, arrived=0.0,
                      pages=sched.allocator.alloc(sched.workers.pages_needed(len(prompt) + params.max_new_tokens)))
    first = sched.workers.forward([SeqChunk(prompt, 0, r.pages)])[0][-1].argmax()
    r.stops = sched.stop_strings.new(params)
    sched._commit(r, [int(first)], first=True)
    return r


@pytest.mark.parametrize("right_every", [1, 3])
def test_accepted_runs_on_the_real_model_equal_greedy(setup, model_dir, right_every):
    """Proposals equal the greedy continuation except at every `right_every`-th draft slot
    (1: always right). Two ragged requests decode in one batch."""
    draft, prompts, want = setup
    sched = scheduler(model_dir, draft)
    sent = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    sched.workers.rank.runner.draft_block = known_proposals(prompts, want, right_every)
    try:
        for room, p in enumerate(prompts):
            adopt(sched, room, p, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
        while sched.running:
            sched._decode()
        outs = {ev.room: [] for ev in sent}
        verify = {ev.room: 0 for ev in sent}
        for ev in sent:
            outs[ev.room] += ev.token_ids
            verify[ev.room] += len(ev.spec_accept)
        assert [outs[i] for i in range(len(prompts))] == want
        if right_every == 1:  # 13 tokens after the first, 4 per verify: 4 + 4 + 4 + 1
            assert all(v == 4 for v in verify.values()), verify
        else:  # each verify commits the right drafts before the first wrong slot, plus one
            per = right_every
            assert all(v == -(-(MAX_NEW - 1) // per) for v in verify.values()), (verify, per)
        assert sched.allocator.num_free == sched.allocator.num_pages
    finally:
        sched.close()


@pytest.mark.parametrize("logprobs", [-1, 2])
def test_stop_string_inside_an_accepted_run(setup, model_dir, logprobs):
    """Every draft is right, so each verify accepts a run of B tokens; a stop string completed
    by a token in the middle of a run ends the request at that token: nothing after it is
    committed, streamed, counted (completion_tokens, the verify's accepted count) or given a
    logprob, and the pages come back."""
    draft, prompts, want = setup
    tok = Tokenizer.from_dir(model_dir)
    out = want[1]
    # The first token comes from prefill, verify 1 commits out[1:5]: a stop string whose first
    # occurrence ends at out[2] (mid-run) ends the request with 3 tokens.
    k, stop = next((k, s) for k in range(3, len(out)) for s in [tok.decode(out[k - 1:k]).strip()]
                   if s and s not in tok.decode(out[:k - 1]) and (k - 1) % B not in (0, B - 1))
    assert k < MAX_NEW and stop in tok.decode(out[:k])
    sched = scheduler(model_dir, draft)
    sent = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    sched.workers.rank.runner.draft_block = known_proposals(prompts, want, 1)
    try:
        r = adopt(sched, 0, prompts[1], SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                                                       stop=[stop]))
        r.req.spec.logprobs = logprobs
        while sched.running:
            sched._decode()
        toks = [t for ev in sent for t in ev.token_ids]
        assert toks == out[:k]
        last = sent[-1]
        assert last.finish_reason == "stop" and last.matched_stop == stop and last.completion_tokens == k
        assert sum(n for ev in sent for n in ev.spec_accept) == k - 1  # committed, not accepted, counts
        if logprobs >= 0:
            assert sum(len(ev.logprobs) for ev in sent[1:]) == k - 1
        assert sched.allocator.num_free == sched.allocator.num_pages
    finally:
        sched.close()

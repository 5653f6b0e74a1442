"""The per-step delta protocol (engine/step_delta.py): on fresh random sequences of scheduler
events — requests joining, decoding, being given pages (a new list or in place), preempted
(pages replaced), aborted, finished; n > 1 choices whose tables share a prefix; a prompt's
chunks in consecutive micro-batches; speculative steps; steps without a batch — every batch a
follower rebuilds from the pickled deltas equals the scheduler's, and its tables equal exactly
the tables of the scheduler's last batch."""

from __future__ import annotations

import pickle
import random

import pytest

from glm53.models import SeqChunk
from glm53.models.draft import DraftBlock, DraftSampling
from glm53.server.engine.step_delta import BatchDelta, DeltaDecoder, DeltaEncoder


class _Req:
    def __init__(self, pages: list[int], pos: int):
        self.pages, self.pos = pages, pos


def _new_pages(rng: random.Random, n: int) -> list[int]:
    # Large ids, so equal values are mostly distinct int objects (no small-int identity shortcut).
    return [rng.randrange(1000, 10**6) for _ in range(n)]


def _event(rng: random.Random, reqs: list[_Req]) -> None:
    """One random change of the running set between two steps."""
    kind = rng.choice(["join", "join", "choices", "finish", "abort", "append", "append_new", "preempt",
                       "preempt_in_place", "edit_in_place", "none", "none"])
    if kind == "join" or not reqs:
        reqs.append(_Req(_new_pages(rng, rng.randint(1, 12)), rng.randrange(0, 64)))
    elif kind == "choices":  # n > 1: distinct lists, the prompt's full pages shared
        head = _new_pages(rng, rng.randint(1, 6))
        for _ in range(rng.randint(2, 3)):
            reqs.append(_Req(head + _new_pages(rng, 2), len(head) * 16))
    elif kind in ("finish", "abort"):
        reqs.pop(rng.randrange(len(reqs)))
    elif kind == "append":
        rng.choice(reqs).pages.extend(_new_pages(rng, rng.randint(1, 3)))
    elif kind == "append_new":
        r = rng.choice(reqs)
        r.pages = r.pages + _new_pages(rng, rng.randint(1, 3))
    elif kind == "preempt":  # back in the queue, readmitted with other pages
        r = rng.choice(reqs)
        r.pages, r.pos = _new_pages(rng, rng.randint(1, 12)), 0
    elif kind == "preempt_in_place":
        r = rng.choice(reqs)
        r.pages[:] = _new_pages(rng, rng.randint(1, len(r.pages)))
    elif kind == "edit_in_place":
        r = rng.choice(reqs)
        r.pages[rng.randrange(len(r.pages))] = rng.randrange(10**6, 2 * 10**6)


def _batch(rng: random.Random, reqs: list[_Req]):
    """A step's batch: (micro-batches, None), (None, draft blocks), or (None, None) — a sync."""
    mode = rng.choice(["decode", "decode", "prefill", "spec", "sync"])
    if mode == "sync" or not reqs:
        return None, None
    if mode == "spec":
        return None, [DraftBlock(last_token=rng.randrange(5000), start_pos=r.pos, page_table=r.pages,
                                 ctx_start=rng.randrange(r.pos + 1), block_size=rng.choice([None, 1, 4]),
                                 key=rng.choice([None, rng.randrange(10**6)]),
                                 sampling=rng.choice([None, DraftSampling(rng.uniform(0.1, 2), rng.randrange(50),
                                                                          rng.random(), rng.random() / 4,
                                                                          rng.getrandbits(62))]))
                      for r in reqs]
    if mode == "decode":
        return [[SeqChunk([rng.randrange(5000)], r.pos, r.pages) for r in reqs]], None
    # prefill: a subset, one request's consecutive chunks in consecutive micro-batches
    some = rng.sample(reqs, rng.randint(1, len(reqs)))
    mbs = [[SeqChunk([rng.randrange(5000) for _ in range(rng.randint(1, 5))], r.pos, r.pages,
                     all_logits=rng.random() < 0.3) for r in some]]
    mbs.append([SeqChunk([rng.randrange(5000)], some[0].pos + 5, some[0].pages)])
    return mbs, None


# Six fixed sequences and a fresh one each run (its seed is in the test id, to replay a failure).
@pytest.mark.parametrize("seed", [*range(6), random.SystemRandom().randrange(2**32)])
def test_followers_rebuild_every_batch_and_hold_exactly_its_tables(seed):
    rng = random.Random(seed * 7919 + 1)
    enc, followers = DeltaEncoder(), [DeltaDecoder(), DeltaDecoder()]
    reqs: list[_Req] = []
    last_tables: list[list[int]] = []
    sent_pages = whole_pages = 0
    for _ in range(400):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            _event(rng, reqs)
        for r in reqs:
            r.pos += 1
        mbs, spec = _batch(rng, reqs)
        wire = pickle.dumps(enc.encode(mbs, spec))
        for f in followers:
            got = f.decode(pickle.loads(wire))
            assert got == (mbs or None, spec or None)
        if mbs or spec:
            rows = [c for mb in mbs for c in mb] if mbs else spec
            last_tables = [list(t) for t in {id(x.page_table): x.page_table for x in rows}.values()]
            whole_pages += sum(len(x.page_table) for x in rows)
        delta = pickle.loads(wire)
        sent_pages += sum(len(p) for _, p in delta.joins) + sum(len(p) for _, p in delta.appends)
        for f in followers:
            assert sorted(f.tables.values()) == sorted(last_tables)
            assert f.tables == enc.tables
    # The point of it: far fewer page ids than resending every table every step.
    assert sent_pages < whole_pages / 4, (sent_pages, whole_pages)


def test_a_steady_decode_step_sends_no_pages():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    reqs = [_Req(list(range(1000 + 10 * i, 1010 + 10 * i)), 100) for i in range(64)]
    for step in range(3):
        mbs = [[SeqChunk([7], r.pos + step, r.pages) for r in reqs]]
        delta = enc.encode(mbs, None)
        assert dec.decode(pickle.loads(pickle.dumps(delta))) == (mbs, None)
    assert delta.joins == delta.appends == delta.leaves == []
    assert len(pickle.dumps(delta)) < (4 + 1) * 64 * 8 + 400  # rows (4 int64 each), tokens, a little framing


def test_a_delta_naming_an_unknown_table_is_an_error():
    with pytest.raises(RuntimeError, match="does not hold"):
        DeltaDecoder().decode(BatchDelta(appends=[(3, [1])]))


def test_the_mtp_seed_reaches_the_followers():
    """A request's first MTP step carries prefill's hidden row (`DraftBlock.seed_hidden`): every
    follower rebuilds it bit for bit (bf16 here), on its block only; the next step has none."""
    import torch

    enc, f = DeltaEncoder(), DeltaDecoder()
    h = torch.randn(64).to(torch.bfloat16)
    pages = [[1, 2], [3]]
    blocks = [DraftBlock(last_token=7, start_pos=5, page_table=pages[0], key=1, seed_hidden=h),
              DraftBlock(last_token=9, start_pos=2, page_table=pages[1], key=2)]
    _, got = f.decode(pickle.loads(pickle.dumps(enc.encode(None, blocks))))
    assert torch.equal(got[0].seed_hidden, h) and got[0].seed_hidden.dtype == torch.bfloat16
    assert got[1].seed_hidden is None
    assert [(b.last_token, b.start_pos, b.page_table, b.key) for b in got] == [(7, 5, [1, 2], 1), (9, 2, [3], 2)]
    blocks = [DraftBlock(last_token=8, start_pos=6, page_table=pages[0], key=1),
              DraftBlock(last_token=4, start_pos=3, page_table=pages[1], key=2)]
    _, got = f.decode(pickle.loads(pickle.dumps(enc.encode(None, blocks))))
    assert got == blocks

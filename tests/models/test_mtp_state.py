"""The MTP draft's static-buffer step (models/mtp_state.py, mtp_graph.py), run eagerly on CPU
tensors: over consecutive steps where requests join (from prefill's seed row or without one, one
without a key), leave, sample or not, accept different numbers of tokens and verify fewer than K
near their end, the padded, fixed-width step gives the eager `_mtp_step`'s drafts, verify
argmaxes, logits, q and kept hidden rows, whichever of the two kept the previous step's state;
nothing but the requests' own pages and the padding page is ever written. (Capture and replay:
test_gpu_mtp.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from glm53.models import DraftBlock, GlmConfig, ModelRunner, PageAllocator, SeqChunk
from glm53.models.draft import DraftSampling
from glm53.models.graph import batch_buckets, pick
from glm53.models.mtp_graph import MTPSteps
from glm53.models.mtp_state import NO_TOP_K, MTPRow, MTPState
from glm53.support.mtp_checkpoint import random_nextn, write_mtp_layer
from glm53.support.oracle import make_checkpoint

PS, PAGES, K, MAX_BS = 4, 96, 4, 6  # the runner holds PAGES + 1 pages: page PAGES is the padding page

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp_state") / "target"
    make_checkpoint(d, seed=91, index_topk_freq=2, index_skip_topk_offset=2)
    write_mtp_layer(d, random_nextn(GlmConfig.from_dir(d), seed=92))
    return ModelRunner.from_dir(d, page_size=PS, num_pages=PAGES + 1, progress=False, nextn_steps=K - 1)


def _blocks(running, step):
    out = []
    for r in running:
        samp = None
        if r["sampled"] and step % 3 != 1:  # some steps of a sampled request draft greedily
            samp = DraftSampling(0.9, 5 if r["key"] == 1 else 0, 0.95 if r["key"] == 1 else 1.0, 0.0,
                                 seed=100 * step + r["key"])
        out.append(DraftBlock(r["out"][-1], r["plen"] + len(r["out"]) - 1, r["pages"],
                              block_size=min(K, r["max_new"] - len(r["out"])), sampling=samp,
                              key=r["key"] if r["key"] >= 0 else None,
                              seed_hidden=r.pop("seed", None)))
    return out


def test_static_step_equals_the_eager_step(runner):
    rng = random.Random(5)
    vocab, mtp = runner.cfg.vocab_size, runner.mtp
    alloc = PageAllocator(PAGES)
    never = set(range(PAGES))  # pages no request ever held: they must stay zero
    steps = MTPSteps(runner, MAX_BS, 24, PAGES, K)
    running: list[dict] = []
    mtp.state = {}

    def join(key, seeded, sampled=False):
        plen, new = rng.randrange(3, 40), rng.randrange(7, 18)
        pages = alloc.alloc(runner.pages_needed(plen + new))
        never.difference_update(pages)
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        lg = runner.forward([SeqChunk(prompt, 0, pages)])  # writes the prompt's MTP KV
        r = dict(key=key, pages=pages, plen=plen, out=[int(lg[0][-1].argmax())], max_new=new, sampled=sampled)
        if seeded:
            r["seed"] = lg.last_hidden[0]
        running.insert(rng.randrange(len(running) + 1), r)

    join(0, True)
    join(1, True, sampled=True)
    join(2, False)
    join(-1, True)  # no key: drafts from its seed once, then nothing is kept for it
    seen = dict(short=False, no_draft=False, sampled=False, resident=False, copied=False)
    for step in range(14):
        if step == 3:
            join(3, True, sampled=True)
        if step == 6:
            join(4, False)
        if step == 5 and len(running) > 1:  # leaves before its end (aborted): its state is forgotten
            gone = running.pop(rng.randrange(len(running)))
            alloc.free(gone["pages"])
        if not running:
            break
        blocks = _blocks(running, step)
        rows, _ = steps.rows(blocks)
        n = len(rows)
        bs = pick(batch_buckets(MAX_BS), n)
        width = steps.state.width_needed(rows) + step % 3  # wider than needed: fixed widths are free

        before = dict(mtp.state)
        ref = runner._mtp_step(blocks)
        eager_state = mtp.state
        mtp.state = before
        kept = [b.key for b in blocks if b.key in before]  # whose rows the slots may already hold
        resident = [k for k in kept if k in steps.slots
                    and before[k][2].data_ptr() == steps.state.hidden[steps.slots[k]].data_ptr()]
        seen["resident"] |= bool(resident)
        seen["copied"] |= len(resident) < len(kept)
        got = steps.run_eager(blocks, bs, width)

        assert got.drafts == ref.drafts, step
        assert got.greedy == ref.greedy, step
        for a, b in zip(got.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert (got.probs is None) == (ref.probs is None)
        if ref.probs is not None:
            seen["sampled"] = True
            for a, b in zip(got.probs, ref.probs):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert mtp.state.keys() == eager_state.keys()
        for key, (start, toks, hid) in mtp.state.items():
            assert (start, toks) == eager_state[key][:2]
            torch.testing.assert_close(hid, eager_state[key][2], rtol=1e-4, atol=1e-4)
        seen["short"] |= any(b.block_size < K for b in blocks)
        seen["no_draft"] |= any(not d for d in got.drafts)
        if step % 4 == 3:
            mtp.state = eager_state  # the next step's rows come from an eager step: copied into the slots

        # Commit a random accepted prefix (the state must follow any), then the target's token.
        for r, d, am in zip(running, got.drafts, got.greedy):
            a = rng.randrange(1, len(d) + 2)
            r["out"] += d[: a - 1] + [am[a - 1]]
        for r in [r for r in running if len(r["out"]) >= r["max_new"]]:
            running.remove(r)
            alloc.free(r["pages"])
    assert all(seen.values()), seen
    for _, pool in runner.pools:
        assert not pool.tensor[sorted(never)].any()


def test_state_rows_and_checks(runner):
    st = MTPState(3, 4, PS, PAGES, K, runner.cfg.hidden_size, torch.float32, runner.cfg.max_position_embeddings)
    a = MTPRow(5, 9, 3, (7, 8, 5), (0, 1, 2, 4), slot=2)
    b = MTPRow(6, 2, 2, (), (3,), slot=0)  # nothing to catch up from: verifies [last] alone
    st.update([a, b])
    assert [a.n, b.n] == [4, 1]
    assert st.ints[:, :4].tolist() == [[3, 2, 0, NO_TOP_K], [0, 0, 0, NO_TOP_K], [0, 3, 0, NO_TOP_K]]
    batch, hidden, last = st.catch_up(3, 4)
    assert batch.positions.tolist() == [6, 7, 8, 0] + [0] * 8
    assert batch.input_ids[:4].tolist() == [7, 8, 5, 0]
    assert batch.out_slots.tolist() == [1 * PS + 2, 1 * PS + 3, 2 * PS + 0] + [PAGES * PS] * 9
    assert last.tolist() == [2, 4, 8] and hidden.shape == (12, runner.cfg.hidden_size)
    chained = st.chained(3, 4, 2, torch.tensor([11, 12, 13]))
    assert chained.positions.tolist() == [10, 0, 0] and chained.out_slots.tolist() == [2 * PS + 2] + [PAGES * PS] * 2
    st.update([b])  # a leaves: its row back to the padding request
    assert st.ints[:2, :2].tolist() == [[0, 0], [0, 3]]
    for bad, match in [([MTPRow(1, 2, 3, (1, 2, 3), (0, 1))], "catch-up"),
                       ([MTPRow(1, 9, 4, (1,), (0, 1, 2, 4))], "verifies 1 .. 4"),
                       ([a] * 4, "holds 1 .. 3")]:
        with pytest.raises(ValueError, match=match):
            st.check(bad)
    with pytest.raises(ValueError, match="slot"):
        st.update([MTPRow(1, 2, 1, (1,), (0,))])

"""The DFlash step's device-side batch state and the step the CUDA graphs capture
(models/spec_state.py, spec_graph.py), on CPU tensors: over a run where requests join, leave,
move between rows, accept different numbers of tokens and verify fewer than K near their end, the
static verify batch holds what `build_batch` builds from the eager step's chunks, and the padded,
fixed-width step gives the eager step's drafts, verify logits and argmaxes; nothing but the
requests' own pages and the padding page is ever written. (Capture and replay: test_gpu_spec_graphs.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from glm53.models import DraftBlock, ModelRunner, PageAllocator, SeqChunk
from glm53.models.graph import batch_buckets, pick
from glm53.models.spec_graph import spec_forward, split_output, step_rows
from glm53.models.spec_state import SpecState, StepRow
from glm53.server.engine.spec import greedy_prefix
from glm53.support.oracle import make_checkpoint
from tests.models.draft_oracle import make_draft_checkpoint

PS, PAGES, K = 4, 96, 4  # the runner holds PAGES + 1 pages: page PAGES is the padding page


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_state")
    make_checkpoint(root / "target", seed=61, index_topk_freq=2, index_skip_topk_offset=2)
    make_draft_checkpoint(root / "draft", root / "target", seed=62, target_layer_ids=[1, 2, 4], block_size=K)
    # fp32 drafting products, the graphs' arithmetic (the CPU's bf16 ones would round the padded
    # static batch unlike the eager one)
    return ModelRunner.from_dir(root / "target", page_size=PS, num_pages=PAGES + 1, progress=False,
                                draft_dir=root / "draft", draft_cpu_bf16=False)


def _state(runner: ModelRunner, max_bs: int = 6, max_pages: int = 24) -> SpecState:
    return SpecState(max_bs, max_pages, PS, PAGES, K, runner.draft.cfg.mask_token_id,
                     runner.cfg.max_position_embeddings)


def test_static_step_equals_the_eager_step(runner):
    rng = random.Random(7)
    vocab = runner.cfg.vocab_size
    alloc = PageAllocator(PAGES)
    never = set(range(PAGES))  # pages no request ever held: they must stay zero
    state = _state(runner)
    # requests: dict(pages, prompt, out, ctx_start, max_new)
    running: list[dict] = []

    def join():
        plen, new = rng.randrange(3, 40), rng.randrange(6, 20)
        pages = alloc.alloc(runner.pages_needed(plen + new))
        never.difference_update(pages)
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        first = int(runner.forward([SeqChunk(prompt, 0, pages)])[0][-1].argmax())  # writes the draft context
        # half of them as if the prompt's draft context had not come with the KV
        ctx = plen if rng.random() < 0.5 else 0
        running.insert(rng.randrange(len(running) + 1),
                       dict(pages=pages, plen=plen, out=[first], ctx_start=ctx, max_new=new))

    for _ in range(3):
        join()
    checked_short = False
    for step in range(12):
        if step in (2, 5, 8):
            join()
        if not running:
            break
        blocks = [DraftBlock(r["out"][-1], r["plen"] + len(r["out"]) - 1, r["pages"], ctx_start=r["ctx_start"],
                             block_size=min(K, r["max_new"] - len(r["out"])), end_pos=r["plen"] + r["max_new"])
                  for r in running]
        rows = step_rows(blocks, runner.draft.cfg.block_size)
        checked_short |= any(r.n < K for r in rows)
        state.update(rows)
        n = len(rows)
        bs = pick(batch_buckets(6), n)
        width = state.width_needed(rows) + step % 3  # wider than needed: fixed widths are free

        before = state.rows.clone()
        tokens, logits = spec_forward(runner, state, bs, width)
        assert tokens.shape == (bs, 2 * K) and logits.shape == (bs * K, vocab)
        got = split_output(rows, K, tokens[:n].tolist(), logits)
        # The step left its rows where greedy acceptance moves them (the overlapped loop's next
        # step); the padding rows where they were.
        want = []
        for row, d, am in zip(rows, got.drafts, got.greedy):
            g = greedy_prefix(d, am)
            start = row.start + len(g)
            left = row.end - start - 1
            want.append([g[-1], start, row.ctx_start, min(K, left), row.end] if left > 0 else list(before[len(want)]))
        assert state.rows[:n].tolist() == want
        assert torch.equal(state.rows[n:], before[n:])
        state.rows.copy_(before)  # the host's rows, to rebuild the verify batch below

        # The static verify batch's real tokens are build_batch's for the eager chunks.
        chunks = [SeqChunk([b.last_token, *d], b.start_pos, b.page_table, all_logits=True)
                  for b, d in zip(blocks, got.drafts)]
        ref_batch, _ = runner.build_batch(chunks)
        vb, vn = state.verify_batch(bs, width, tokens[:, : K - 1])
        assert torch.equal(vn, state.rows[:bs, 3])  # no cut: every row verifies its n
        real = torch.tensor([i * K + j for i, r in enumerate(rows) for j in range(r.n)])
        for name in ("input_ids", "positions", "out_slots", "context_lens"):
            assert torch.equal(getattr(vb, name)[real], getattr(ref_batch, name)), name
        for t, c in zip(real.tolist(), [c for c in chunks for _ in c.token_ids]):
            w = min(width, len(c.page_table))  # the width covers the step's positions, not whole tables
            assert vb.page_table[t, :w].tolist() == c.page_table[:w]
        pad = torch.tensor([t for t in range(bs * K) if t not in set(real.tolist())])
        if len(pad):  # padding tokens: position 0 on the padding page
            assert (vb.positions[pad] == 0).all() and (vb.out_slots[pad] == PAGES * PS).all()

        # The eager step (its own widths, no padding) on the same KV: same drafts, same verify.
        ref = runner.spec_step(blocks)
        assert got.drafts == ref.drafts
        assert got.greedy == ref.greedy
        for a, b in zip(got.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

        # Commit a random accepted prefix (the state must follow any), then the target's token.
        for r, b, d, am in zip(running, blocks, got.drafts, got.greedy):
            a = rng.randrange(1, b.block_size + 1)
            r["out"] += d[: a - 1] + [am[a - 1]]
        for r in [r for r in running if len(r["out"]) >= r["max_new"]]:
            running.remove(r)
            alloc.free(r["pages"])
    assert checked_short, "no step verified fewer than K tokens"
    for _, pool in runner.pools:
        assert not pool.tensor[sorted(never)].any()


def test_state_rows_written_only_on_change_and_checks(runner):
    state = _state(runner, max_bs=3, max_pages=4)
    a = StepRow(5, 9, 0, 4, (0, 1, 2, 4))
    b = StepRow(6, 2, 1, 2, (3,))
    state.update([a, b])
    assert state.rows_written == 2 and state.rows[:3].tolist() == [[5, 9, 0, 4, 13], [6, 2, 1, 2, 4],
                                                                   [0, 0, 0, 1, 1]]
    state.update([StepRow(7, 11, 0, 4, a.pages), StepRow(8, 1, 0, 1, b.pages)])  # positions move: no page write
    assert state.rows_written == 2
    state.update([StepRow(8, 2, 0, 1, b.pages)])  # a leaves, b moves to row 0: both rows rewritten
    assert state.rows_written == 4
    assert state.rows[:2].tolist() == [[8, 2, 0, 1, 3], [0, 0, 0, 1, 1]]
    assert state.page_table[:2].tolist() == [[3, -1, -1, -1], [PAGES, -1, -1, -1]]
    assert state.width_needed([a, b]) == 4  # positions 9 .. 12 reach page 3
    d = state.draft_inputs(2, 2)
    assert d.mask.shape == (2, 2 * PS + K) and d.table.tolist() == [[3, PAGES], [PAGES, PAGES]]
    # row 0: context [0, 2) visible, block position 0 only; row 1 (padding): block position 0 only
    assert d.mask[0].tolist() == [True, True] + [False] * 6 + [True, False, False, False]
    assert d.mask[1].tolist() == [False] * 8 + [True, False, False, False]
    for bad, match in [([a] * 4, "holds 1 .. 3"), ([StepRow(1, 0, 0, 5, (0,))], "verifies 1 .. 4"),
                       ([StepRow(1, 2, 3, 1, (0,))], "ctx_start"), ([StepRow(1, 4, 0, 1, (0,))], "cannot hold"),
                       ([StepRow(1, 0, 0, 1, (0, 1, 2, 3, 4))], "exceeds the state's width"),
                       ([StepRow(1, 2, 0, 2, (0,), end=3)], "end 3 before")]:
        with pytest.raises(ValueError, match=match):
            state.check(bad)
    with pytest.raises(ValueError, match="outside"):
        state.draft_inputs(4, 2)
    assert step_rows([DraftBlock(1, 2, [0])], 16)[0].n == 16  # no block_size: the draft's

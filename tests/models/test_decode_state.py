"""The device-side decode batch state (models/decode_state.py) on CPU tensors: after every step of
a run where requests join, leave and move between rows, its batch holds what `build_batch` builds
from the same chunks, rows are rewritten only when they change, and the model's logits over it
(padded rows, fixed widths) equal the eager forward's."""

from __future__ import annotations

import random

import pytest
import torch

from glm53.kernels.rope import rope_cos_sin
from glm53.models import ModelRunner, PageAllocator, SeqChunk
from glm53.models.decode_state import DecodeState
from glm53.models.graph import batch_buckets, pick, width_buckets
from glm53.support.oracle import make_checkpoint

PS = 4


def _check_rows(state: DecodeState, runner: ModelRunner, chunks: list[SeqChunk], bs: int, width: int) -> None:
    ref, _ = runner.build_batch(chunks)
    got = state.batch(bs, width, runner.model.inv_freq)
    # the coords and cos/sin the step-inputs op hands with the batch (kernels/step_inputs)
    assert all(torch.equal(a, b) for a, b in zip(got.out_coords(PS), (got.out_slots // PS, got.out_slots % PS)))
    assert all(torch.equal(a, b) for a, b in zip(got.rope, rope_cos_sin(got.positions, runner.model.inv_freq)))
    n = len(chunks)
    assert got.max_context == width * PS
    for name in ("input_ids", "positions", "out_slots", "context_lens"):
        assert torch.equal(getattr(got, name)[:n], getattr(ref, name)), name
    for i, c in enumerate(chunks):
        k = len(c.page_table)
        assert got.page_table[i, :k].tolist() == c.page_table
        assert (got.page_table[i, k:] == -1).all()
    # padding rows: position 0 on the padding page, nothing else
    assert (got.positions[n:] == 0).all() and (got.out_slots[n:] == state.pad_page * PS).all()
    assert (got.page_table[n:, 0] == state.pad_page).all() and (got.page_table[n:, 1:] == -1).all()


def test_buckets():
    assert batch_buckets(1) == (1,) and batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert width_buckets(100, 64) == (64, 100)  # 4096 tokens = 64 pages of 64, then the longest
    assert width_buckets(3000, 16) == (256, 1024, 3000)
    assert pick((1, 2, 4), 3) == 4 and pick((1, 2, 4), 5) is None


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(path, seed=3, index_topk_freq=2, index_skip_topk_offset=2)
    # one page more than the allocator hands out: the padding page
    return ModelRunner.from_dir(path, page_size=PS, num_pages=97, progress=False)


def test_incremental_state_matches_build_batch_and_eager_logits(runner):
    rng = random.Random(5)
    alloc = PageAllocator(96)
    state = DecodeState(max_bs=6, max_pages=12, page_size=PS, pad_page=96,
                        max_position=runner.cfg.max_position_embeddings)
    # requests: [pages, next position, last token]; prompts of random length already "in" the cache
    running: list[list] = []
    vocab = runner.cfg.vocab_size
    for step in range(14):
        if step in (0, 3, 6):  # joins (two at once at step 0)
            for _ in range(2 if step == 0 else 1):
                plen = rng.randrange(1, 30)
                pages = alloc.alloc(runner.pages_needed(plen + 16))
                # a prompt's KV: prefill it eagerly (random tokens) so attention reads real values
                runner.forward([SeqChunk([rng.randrange(vocab) for _ in range(plen)], 0, pages)])
                running.insert(rng.randrange(len(running) + 1), [pages, plen, rng.randrange(vocab)])
        if step in (5, 9, 11):  # leaves from the middle: the rows after it move up
            alloc.free(running.pop(len(running) // 2)[0])
        chunks = [SeqChunk([tok], pos, pages) for pages, pos, tok in running]
        before = state.rows_written
        state.update(chunks)
        if step in (1, 2, 4, 7, 8):  # nothing joined or left: no row is rewritten
            assert state.rows_written == before
        bs = pick(batch_buckets(6), len(chunks)) or len(chunks)
        width = max(len(c.page_table) for c in chunks) + 1  # wider than needed: fixed widths are free
        _check_rows(state, runner, chunks, bs, width)
        # the decode step itself, eagerly (build_batch); it writes the real rows' KV
        eager = torch.cat(runner.forward(chunks))
        if step % 4 == 1:
            # The model over the padded, fixed-width state batch: same logits for the real rows
            # (it rewrites their KV with the same values, and the padding row's on the padding page).
            batch = state.batch(bs, width, runner.model.inv_freq)
            logits = runner.model.logits(runner.model.forward_stage(batch, runner.pools, None).hidden)
            torch.testing.assert_close(logits[: len(chunks)], eager, rtol=1e-4, atol=1e-4)
            assert torch.equal(logits[: len(chunks)].argmax(-1), eager.argmax(-1))
        for r, t in zip(running, eager.argmax(-1).tolist()):
            r[1] += 1
            r[2] = t


def test_state_rejects_what_it_cannot_hold(runner):
    state = DecodeState(max_bs=2, max_pages=3, page_size=PS, pad_page=96, max_position=64)
    with pytest.raises(ValueError, match="exceed the state's 2 rows"):
        state.update([SeqChunk([1], 0, [0])] * 3)
    with pytest.raises(ValueError, match="one new token"):
        state.update([SeqChunk([1, 2], 0, [0])])
    with pytest.raises(ValueError, match="cannot hold"):
        state.update([SeqChunk([1], 4, [0])])
    with pytest.raises(ValueError, match="exceeds the state's width"):
        state.update([SeqChunk([1], 0, [0, 1, 2, 3])])
    with pytest.raises(ValueError, match="outside"):
        state.update([SeqChunk([1], 64, list(range(3)))])


def test_device_side_input_tokens(runner):
    """An overlapped step's inputs on the device (runner.DeviceTokens): the state's input ids and
    the eager forward's logits equal those of the same step given the tokens on the host."""
    from glm53.models.runner import DeviceTokens

    alloc = PageAllocator(96)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 14, 5)]
    chunks = []
    for p in prompts:
        pages = alloc.alloc(-(-(len(p) + 2) // PS))
        runner.forward([SeqChunk(p, 0, pages)])
        chunks.append(SeqChunk([0], len(p), pages))
    samples = torch.tensor([7, 31, 19, 4])  # the "previous step's" samples, rows 0..3
    tokens = DeviceTokens(samples, src=[2, 0], dst=[0, 2])  # chunks 0 and 2 take theirs from the device
    host = [SeqChunk([int(samples[2])], chunks[0].start_pos, chunks[0].page_table),
            SeqChunk([55], chunks[1].start_pos, chunks[1].page_table),
            SeqChunk([int(samples[0])], chunks[2].start_pos, chunks[2].page_table)]
    chunks[1].token_ids = [55]

    state = DecodeState(max_bs=4, max_pages=12, page_size=PS, pad_page=96, max_position=runner.cfg.max_position_embeddings)
    state.update(chunks, tokens)
    assert state.input_ids[:3].tolist() == [int(samples[2]), 55, int(samples[0])]

    ref = torch.cat(runner.forward(host))  # writes the same slots with the same values
    got = torch.cat(runner.forward(chunks, tokens=tokens))
    assert torch.equal(got, ref)
    assert torch.equal(runner.decode_rows(chunks, tokens), ref)  # the overlapped loop's entry
    with pytest.raises(ValueError, match="one-token chunks"):
        runner.forward([SeqChunk([1, 2], 0, chunks[0].page_table)], tokens=tokens)


@pytest.mark.parametrize("src,dst", [([1, 2, 3], [0, 1, 2]), ([0, 1, 2], [0, 1, 2]), ([3, 1], [0, 2]), ([2, 1], [0, 1])],
                         ids=["run", "identity", "scattered", "reversed"])
def test_device_tokens_put(src, dst):
    """`DeviceTokens.put` writes values[src[i]] into row dst[i] and nothing else, whether it takes
    the slice copy (consecutive runs) or the index copy; a state whose every row comes from the
    device copies no host tokens over them."""
    from glm53.models.runner import DeviceTokens

    values = torch.randint(100, 1000, (4,), generator=torch.Generator().manual_seed(len(src) + src[0]))
    ids = torch.randint(0, 100, (5,))
    want = ids.clone()
    for s_, d in zip(src, dst):
        want[d] = values[s_]
    tokens = DeviceTokens(values, src, dst)
    tokens.put(ids)
    assert torch.equal(ids, want)
    assert tokens.covers(3) == (sorted(dst) == [0, 1, 2])

    # rows in dst hold a placeholder (their token is on the device), the others a host token
    n = max(dst) + 1
    state = DecodeState(max_bs=4, max_pages=2, page_size=PS, pad_page=9, max_position=64)
    state.update([SeqChunk([-7 if i in dst else 42], 3, [0]) for i in range(n)], tokens)
    assert state.input_ids[:n].tolist() == [int(values[src[dst.index(i)]]) if i in dst else 42 for i in range(n)]


def test_collector_paused_collects_first_and_stays_off():
    """`graph.collector_paused` (around every capture): a dead reference cycle is freed as it
    begins, the collector does not run inside it, and its state comes back after, an error too."""
    import gc
    import weakref

    from glm53.models.graph import collector_paused

    class Node:
        pass

    dead = Node()
    dead.cycle = dead
    ref = weakref.ref(dead)
    del dead
    gc.disable()  # so only collector_paused's own collection can free the cycle
    try:
        assert ref() is not None
        with collector_paused():
            assert ref() is None and not gc.isenabled()
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()

"""Checks of the speculative step's derivations (kernels/spec_inputs.py): the draft's inputs, the
padded verify batch and the rows' advance, each against its torch ops on fresh random states
(requests at random starts, contexts starting late, short blocks, unused page-table entries, the
padding request, drafts matching the target for a random prefix). Shared by the interpreter and
GPU tests. Integers must be equal; cos/sin equal on a GPU (libdevice is what torch's CUDA ops
call) and within an ulp or two under the interpreter (numpy's cos and sin)."""

from __future__ import annotations

import torch

from glm53.kernels.rope import rope_inv_freq
from glm53.kernels.spec_inputs import (
    advance_rows, advance_rows_reference, draft_inputs, draft_inputs_reference, padded_batch, padded_batch_reference,
)

PAD = (0, 0, 0, 1, 1)


def random_state(bs: int, k: int, width: int, ps: int, pages: int, g: torch.Generator, device="cpu"):
    """rows [bs, 5] long and a page table [bs + 1, width + 3] int32 (−1 past a request's pages;
    one more row than asked, so the kernels see a strided, larger table); the last row of `rows`
    the padding request."""
    rows, table = [], torch.full((bs + 1, width + 3), -1, dtype=torch.int32)
    for i in range(bs - 1):
        n = int(torch.randint(1, k + 1, (1,), generator=g))
        start = int(torch.randint(0, width * ps - n + 1, (1,), generator=g))
        ctx0 = int(torch.randint(0, start + 1, (1,), generator=g)) if i % 2 else 0
        end = start + n + int(torch.randint(0, 3 * k, (1,), generator=g))
        rows.append((int(torch.randint(0, 50_000, (1,), generator=g)), start, ctx0, n, end))
        used = -(-(start + n) // ps)
        table[i, :used] = torch.randperm(pages, generator=g)[:used].to(torch.int32)
    rows.append(PAD)
    table[bs - 1, 0] = pages
    return torch.tensor(rows, dtype=torch.long, device=device), table.to(device)


def _rope_close(got, want, device) -> None:
    assert (got is None) == (want is None)
    if got is None:
        return
    for a, b in zip(got, want):
        if device == "cpu":
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
        else:
            assert torch.equal(a, b)


def check_draft_inputs(bs: int, k: int, width: int, ps: int, rope_dim: int | None, device="cpu", seed=0) -> None:
    g = torch.Generator().manual_seed(seed)
    rows, table = random_state(bs, k, width, ps, 4 * bs * width, g, device)
    j, ctx_pos = torch.arange(k, device=device), torch.arange(width * ps + 64, device=device)
    inv = None if rope_dim is None else rope_inv_freq(rope_dim, 1e6, device)
    args = (rows, table[:bs], width, ps, 4 * bs * width, 4159, j, ctx_pos, inv)
    got, want = draft_inputs(*args), draft_inputs_reference(*args)
    for name in ("ids", "positions", "table", "mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    _rope_close(got.rope, want.rope, device)


def check_padded_batch(bs: int, k: int, width: int, ps: int, rope_dim: int | None, split_first: bool,
                       device="cpu", seed=0) -> None:
    """`split_first`: the ids as (last, drafts), as the verify batch passes them; else [bs, K] (the
    prefill graph's). The rows' n also capped by a random cut, as a DSpark block's is."""
    g = torch.Generator().manual_seed(seed)
    rows, table = random_state(bs, k, width, ps, 4 * bs * width, g, device)
    pad_row = table[bs - 1]
    ids = torch.randint(0, 50_000, (bs, k), generator=g).to(device)
    parts = (rows[:, 0], ids[:, 1:]) if split_first else ids  # the last tokens: a column of the rows
    cut = torch.randint(1, k + 1, (bs,), generator=g).to(device)
    n = torch.minimum(rows[:, 3], cut)
    j = torch.arange(k, device=device)
    inv = None if rope_dim is None else rope_inv_freq(rope_dim, 1e6, device)
    args = (parts, rows[:, 1], n, table[:bs], pad_row, width, ps, j, inv)
    want = padded_batch_reference(*args)
    # the cut given as the kept proposals (keep = cut − 1): the batch caps n itself, the same batch
    kept = (parts, rows[:, 1], rows[:, 3], table[:bs], pad_row, width, ps, j, inv, cut - 1)
    for got in (padded_batch(*args), padded_batch(*kept), padded_batch_reference(*kept)):
        for name in ("input_ids", "positions", "out_slots", "page_table", "context_lens", "page", "offset", "n"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        _rope_close(got.rope, want.rope, device)


def check_advance(bs: int, k: int, device="cpu", seed=0) -> None:
    """Drafts equal to the target's tokens for a random prefix (all of them in some rows), random
    verified counts, rows near their end (nothing left: they stay) and the padding request."""
    g = torch.Generator().manual_seed(seed)
    rows, _ = random_state(bs, k, 64, 16, 4 * bs * 64, g, device)
    target = torch.randint(0, 50, (bs, k), generator=g)
    drafts = target[:, : k - 1].clone()
    for i in range(bs):
        m = int(torch.randint(0, k, (1,), generator=g))  # drafts past m differ (m = k − 1: none)
        drafts[i, m:] += 1 + torch.randint(0, 5, (k - 1 - m,), generator=g)
    verified = torch.minimum(rows[:, 3].cpu(), torch.randint(1, k + 1, (bs,), generator=g))
    tokens = torch.cat([drafts, target, verified[:, None]], dim=1).to(device)
    assert tokens.shape == (bs, 2 * k)
    got, want = rows.clone(), rows.clone()
    advance_rows(got, tokens, torch.arange(k, device=device))
    advance_rows_reference(want, tokens, torch.arange(k, device=device))
    assert torch.equal(got, want)
    assert not torch.equal(got, rows), "no row moved: the case tests nothing"

"""`spec_inputs` as Triton kernels: the draft's inputs, the padded verify batch and the rows'
advance, one launch each. Compiled, cos/sin are libdevice's (the CUDA math library's cosf/sinf,
which torch's CUDA ops call); the interpreter has no libdevice and runs `tl.cos`/`tl.sin`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting
from glm53.kernels.rope_triton import cos_sin


@triton.jit
def _store_cos_sin(cos_ptr, sin_ptr, inv_ptr, pos, tok, live, HALF: tl.constexpr, LIBDEVICE: tl.constexpr):
    """cos/sin [·, HALF] rows `tok` of positions `pos` (rows where `live`): one fp32 product, as
    `rope.rope_cos_sin` computes it."""
    f = tl.arange(0, HALF)
    c, s = cos_sin(pos.to(tl.float32)[:, None] * tl.load(inv_ptr + f)[None, :], LIBDEVICE)
    at = tok.to(tl.int64)[:, None] * HALF + f[None, :]
    tl.store(cos_ptr + at, c, mask=live[:, None])
    tl.store(sin_ptr + at, s, mask=live[:, None])


@triton.jit
def _draft_inputs_kernel(rows_ptr, table_ptr, ids_ptr, pos_ptr, tab_ptr, mask_ptr, inv_ptr, cos_ptr, sin_ptr,
                         stride_t, W, PAD_PAGE, MASK_ID, PS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                         BLOCK: tl.constexpr, BW: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
    """Program (i, b): block b of row i's key mask; block 0 also writes the row's ids, positions,
    pages and cos/sin."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    row = rows_ptr + i * 5
    start = tl.load(row + 1)
    ctx0 = tl.load(row + 2)
    n = tl.load(row + 3)
    span = W * PS
    c = b * BLOCK + tl.arange(0, BLOCK)
    seen = tl.where(c < span, (c >= ctx0) & (c < start), (c - span) < n)
    tl.store(mask_ptr + i * (span + K) + c, seen.to(tl.uint8), mask=c < span + K)
    if b == 0:
        j = tl.arange(0, KP)
        jm = j < K
        tl.store(ids_ptr + i * K + j, tl.where(j == 0, tl.load(row), MASK_ID).to(tl.int64), mask=jm)
        p = start + j
        tl.store(pos_ptr + i * K + j, p, mask=jm)
        for w0 in range(0, W, BW):
            w = w0 + tl.arange(0, BW)
            pg = tl.load(table_ptr + i * stride_t + w, mask=w < W, other=0).to(tl.int64)
            tl.store(tab_ptr + i * W + w, tl.where(pg < 0, PAD_PAGE, pg), mask=w < W)
        if ROPE:
            _store_cos_sin(cos_ptr, sin_ptr, inv_ptr, p, i * K + j, jm, HALF, LIBDEVICE)


def draft_inputs_triton(rows: torch.Tensor, page_table: torch.Tensor, width: int, page_size: int, pad_page: int,
                        mask_token_id: int, k: int, inv_freq: torch.Tensor | None):
    bs, dev = rows.shape[0], rows.device
    span = width * page_size
    ids = torch.empty(bs, k, dtype=torch.long, device=dev)
    positions = torch.empty(bs * k, dtype=torch.long, device=dev)
    table = torch.empty(bs, width, dtype=torch.long, device=dev)
    mask = torch.empty(bs, span + k, dtype=torch.uint8, device=dev)
    half = 1 if inv_freq is None else inv_freq.shape[0]
    cos, sin = (torch.empty(bs * k, half, dtype=torch.float32, device=dev) for _ in range(2))
    block = min(1024, triton.next_power_of_2(span + k))
    _draft_inputs_kernel[(bs, triton.cdiv(span + k, block))](
        rows, page_table, ids, positions, table, mask, cos if inv_freq is None else inv_freq, cos, sin,
        page_table.stride(0), width, pad_page, mask_token_id, PS=page_size, K=k, KP=triton.next_power_of_2(k),
        BLOCK=block, BW=min(256, triton.next_power_of_2(width)), HALF=half, ROPE=inv_freq is not None,
        LIBDEVICE=not triton_interpreting(), num_warps=4,
    )
    return ids, positions, table, mask.view(torch.bool), None if inv_freq is None else (cos, sin)


@triton.jit
def _padded_batch_kernel(first_ptr, rest_ptr, start_ptr, n_ptr, table_ptr, pad_ptr, inv_ptr, ids_ptr, pos_ptr,
                         slot_ptr, rows_ptr, len_ptr, page_ptr, off_ptr, cos_ptr, sin_ptr, keep_ptr, nout_ptr,
                         stride_f, stride_r, stride_s, stride_n, stride_t, W, K,
                         PS: tl.constexpr, BJ: tl.constexpr, BW: tl.constexpr, FIRST: tl.constexpr,
                         HALF: tl.constexpr, ROPE: tl.constexpr, LIBDEVICE: tl.constexpr, KEEP: tl.constexpr):
    """Program (i, b): tokens [b·BJ, (b + 1)·BJ) of row i. FIRST: token 0 from `first`, token j ≥ 1
    from rest[j − 1]; else every token from `rest` (the ids [bs, K]). KEEP: the row's n capped at
    keep + 1 (written to nout by the row's first program)."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    jm = j < K
    start = tl.load(start_ptr + i * stride_s)
    n = tl.load(n_ptr + i * stride_n)
    if KEEP:
        n = tl.minimum(n, tl.load(keep_ptr + i) + 1)
        if tl.program_id(1) == 0:
            tl.store(nout_ptr + i, n)
    valid = j < n
    pos = tl.where(valid, start + j, 0)
    tok = i * K + j
    if FIRST:
        rest = tl.load(rest_ptr + i * stride_r + j - 1, mask=jm & (j > 0), other=0)
        ids = tl.where(j == 0, tl.load(first_ptr + i * stride_f), rest)
    else:
        ids = tl.load(rest_ptr + i * stride_r + j, mask=jm, other=0)
    tl.store(ids_ptr + tok, ids.to(tl.int64), mask=jm)
    tl.store(pos_ptr + tok, pos, mask=jm)
    at = pos // PS
    own = tl.load(table_ptr + i * stride_t + at, mask=jm & valid, other=0)
    pad = tl.load(pad_ptr + at, mask=jm & (j >= n), other=0)
    page = tl.where(valid, own, pad).to(tl.int64)
    off = pos % PS
    tl.store(slot_ptr + tok, page * PS + off, mask=jm)
    tl.store(page_ptr + tok, page, mask=jm)
    tl.store(off_ptr + tok, off, mask=jm)
    tl.store(len_ptr + tok, (pos + 1).to(tl.int32), mask=jm)
    for w0 in range(0, W, BW):
        w = w0 + tl.arange(0, BW)
        wm = w < W
        own_row = tl.load(table_ptr + i * stride_t + w, mask=wm, other=0)
        pad_row = tl.load(pad_ptr + w, mask=wm, other=0)
        vals = tl.where(valid[:, None], own_row[None, :], pad_row[None, :])
        tl.store(rows_ptr + tok[:, None] * W + w[None, :], vals, mask=jm[:, None] & wm[None, :])
    if ROPE:
        _store_cos_sin(cos_ptr, sin_ptr, inv_ptr, pos, tok, jm, HALF, LIBDEVICE)


def padded_batch_triton(parts: tuple[torch.Tensor, ...], start: torch.Tensor, n: torch.Tensor, table: torch.Tensor,
                        pad_row: torch.Tensor, width: int, page_size: int, k: int, inv_freq: torch.Tensor | None,
                        keep: torch.Tensor | None = None):
    bs, dev = start.shape[0], start.device
    assert keep is None or (keep.shape == (bs,) and keep.dtype == torch.long and keep.stride(0) == 1)
    n_out = n if keep is None else torch.empty(bs, dtype=torch.long, device=dev)
    N = bs * k
    ids, pos, slots, page, off = (torch.empty(N, dtype=torch.long, device=dev) for _ in range(5))
    rows = torch.empty(N, width, dtype=torch.int32, device=dev)
    lens = torch.empty(N, dtype=torch.int32, device=dev)
    half = 1 if inv_freq is None else inv_freq.shape[0]
    cos, sin = (torch.empty(N, half, dtype=torch.float32, device=dev) for _ in range(2))
    first, rest = parts if len(parts) == 2 else (parts[0], parts[0])
    bj = min(64, triton.next_power_of_2(k))
    _padded_batch_kernel[(bs, triton.cdiv(k, bj))](
        first, rest, start, n, table, pad_row, cos if inv_freq is None else inv_freq, ids, pos, slots, rows, lens, page,
        off, cos, sin, n if keep is None else keep, n_out, first.stride(0), rest.stride(0), start.stride(0),
        n.stride(0), table.stride(0), width, k, PS=page_size, BJ=bj, BW=min(2048 // bj, triton.next_power_of_2(width)),
        FIRST=len(parts) == 2, HALF=half, ROPE=inv_freq is not None, LIBDEVICE=not triton_interpreting(),
        KEEP=keep is not None, num_warps=4,
    )
    return ids, pos, slots, rows, lens, page, off, None if inv_freq is None else (cos, sin), n_out


@triton.jit
def _advance_kernel(rows_ptr, tok_ptr, K: tl.constexpr, KP: tl.constexpr):
    """Program i: row i past its step (greedy acceptance; `spec_inputs.advance_rows`)."""
    i = tl.program_id(0).to(tl.int64)
    row = rows_ptr + i * 5
    last = tl.load(row)
    start = tl.load(row + 1)
    n = tl.load(row + 3)
    end = tl.load(row + 4)
    t = tok_ptr + i * (2 * K)
    j = tl.arange(0, KP)
    drafts = tl.load(t + j, mask=j < K - 1, other=0)
    target = tl.load(t + K - 1 + j, mask=j < K, other=0)
    verified = tl.load(t + 2 * K - 1)
    match = (drafts == target) & (j < verified - 1)
    # the leading matches: the first draft position that does not match (K − 1 if all do)
    accepted = tl.min(tl.where(match | (j >= K - 1), K - 1, j), 0).to(tl.int64)
    token = tl.sum(tl.where(j == accepted, target, 0), 0)
    nxt = start + accepted + 1
    left = end - nxt - 1
    live = left > 0
    tl.store(row, tl.where(live, token, last))
    tl.store(row + 1, tl.where(live, nxt, start))
    tl.store(row + 3, tl.where(live, tl.minimum(left, K), n))


def advance_rows_triton(rows: torch.Tensor, tokens: torch.Tensor) -> None:
    bs, k = rows.shape[0], tokens.shape[1] // 2
    if bs:
        _advance_kernel[(bs,)](rows, tokens, K=k, KP=triton.next_power_of_2(k), num_warps=1)

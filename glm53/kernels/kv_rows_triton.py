"""`kv_rows.store_rows` as one Triton kernel: a program finishes one token's row and stores it.

The row is loaded whole; the norm's statistics come from its first `norm_d` columns. A rotated
column's partner (the other element of its pair) is loaded again from x and normed the same
way, so no value moves between threads and x is never written. Roundings follow the torch ops
the reference runs on a GPU: RMSNorm as `norm_triton` (normalise in fp32, round, times the
weight, round), LayerNorm in fp32 rounded once, the rotation as `rope_triton` (`rotate_pair`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.norm_triton import load_row
from glm53.kernels.rope_triton import rotate_pair
from glm53.kernels.row_parts import RowParts, row_source

@triton.jit
def _normed(x, w_ptr, b_ptr, col, mask, mean, rstd, LAYER: tl.constexpr, dt: tl.constexpr):
    """Column `col`'s normed value from its raw x (statistics given), in fp32 after the rounding."""
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    if LAYER:
        b = tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
        return ((x - mean) * rstd * w + b).to(dt).to(tl.float32)
    n = (x * rstd).to(dt).to(tl.float32)
    return (w * n).to(dt).to(tl.float32)


@triton.jit
def _store_rows_kernel(x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, cache_ptr, page_ptr, off_ptr, W, stride_x, stride_c,
                       stride_cp, stride_co, eps, stride_xp, NORM_D: tl.constexpr, ROPE_LO: tl.constexpr,
                       HALF: tl.constexpr, LAYER: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr,
                       XPARTS: tl.constexpr, PDL: tl.constexpr = False):
    # XPARTS > 1: x is a sum not taken yet (`norm_triton.load_row`), taken in the cache's dtype
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    t = tl.program_id(0).to(tl.int64)
    dt = cache_ptr.dtype.element_ty
    row = t * stride_x
    d = tl.arange(0, BLOCK)
    inrow = d < W
    x = load_row(x_ptr, row + d, inrow, stride_xp, XPARTS, dt).to(tl.float32)
    normed = d < NORM_D
    xn = tl.where(normed, x, 0.0)
    if LAYER:
        mean = tl.sum(xn, 0) / NORM_D
        xc = tl.where(normed, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / NORM_D + eps)
    else:
        mean = 0.0
        rstd = 1.0 / tl.sqrt(tl.sum(xn * xn, 0) / NORM_D + eps)
    v = tl.where(normed, _normed(x, w_ptr, b_ptr, d, normed, mean, rstd, LAYER, dt), x)

    # the rotation: output column ROPE_LO + j (j < HALF) is o1 of pair j, ROPE_LO + HALF + j its o2
    rel = d - ROPE_LO
    rot = (rel >= 0) & (rel < 2 * HALF)
    i = tl.where(rot, rel % HALF, 0)
    first = rel < HALF
    if INTERLEAVE:  # pair i is (2i, 2i + 1)
        a_col, b_col = ROPE_LO + 2 * i, ROPE_LO + 2 * i + 1
    else:  # halves
        a_col, b_col = ROPE_LO + i, ROPE_LO + HALF + i
    xa = load_row(x_ptr, row + a_col, rot, stride_xp, XPARTS, dt).to(tl.float32)
    xb = load_row(x_ptr, row + b_col, rot, stride_xp, XPARTS, dt).to(tl.float32)
    xa = tl.where(a_col < NORM_D, _normed(xa, w_ptr, b_ptr, a_col, rot & (a_col < NORM_D), mean, rstd, LAYER, dt), xa)
    xb = tl.where(b_col < NORM_D, _normed(xb, w_ptr, b_ptr, b_col, rot & (b_col < NORM_D), mean, rstd, LAYER, dt), xb)
    c = tl.load(cos_ptr + t * stride_c + i, mask=rot, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + i, mask=rot, other=0.0).to(dt).to(tl.float32)
    # o1 = x1·c − x2·s, o2 = x2·c + x1·s with x1 = xa, x2 = xb, rounded as `rope_triton` rounds
    o = rotate_pair(tl.where(first, xa, xb), tl.where(first, xb, xa), c, tl.where(first, s, -s), dt)
    v = tl.where(rot, o.to(tl.float32), v)

    page = tl.load(page_ptr + t).to(tl.int64)
    off = tl.load(off_ptr + t).to(tl.int64)
    tl.store(cache_ptr + page * stride_cp + off * stride_co + d, v.to(dt), mask=inrow)


def store_rows_triton(x: torch.Tensor | RowParts, cache: torch.Tensor, coords: tuple[torch.Tensor, torch.Tensor],
                      weight: torch.Tensor, bias: torch.Tensor | None, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, norm_d: int, rope_lo: int, interleave: bool) -> None:
    """`kv_rows.store_rows` in one launch; x may be a `RowParts` (its sum taken here)."""
    N, W = x.shape
    half = cos.shape[1]
    page, off = coords
    src, x_parts, stride_xp, _ = row_source(x)
    assert cache.dim() == 3 and cache.shape[2] == W and cache.stride(2) == 1 and src.stride(1) == 1
    assert cache.dtype == x.dtype, (cache.dtype, x.dtype)
    assert weight.shape == (norm_d,) and (bias is None or bias.shape == (norm_d,)) and 0 < norm_d <= W
    assert cos.shape == sin.shape == (N, half) and cos.stride() == sin.stride() and rope_lo + 2 * half <= W
    assert page.shape == off.shape == (N,)
    if N == 0:
        return
    BLOCK = triton.next_power_of_2(W)
    _store_rows_kernel[(N,)](
        src, weight, weight if bias is None else bias, cos, sin, cache, page, off, W, src.stride(0), cos.stride(0),
        cache.stride(0), cache.stride(1), eps, stride_xp, NORM_D=norm_d, ROPE_LO=rope_lo, HALF=half,
        LAYER=bias is not None, INTERLEAVE=interleave, BLOCK=BLOCK, XPARTS=x_parts,
        num_warps=max(1, min(8, BLOCK // 256)), **early_args(),
    )

"""`kv_rows.store_rows` as one Triton kernel: a program finishes one token's row and stores it;
a layer's two rows (the latent and the indexer key) go in one launch, a program for each.

The row is loaded whole; the norm's statistics come from its first `norm_d` columns. A rotated
column's partner (the other element of its pair) is loaded again from x and normed the same
way, so no value moves between threads and x is never written. Roundings follow the torch ops
the reference runs on a GPU: RMSNorm as `norm_triton` (normalise in fp32, round, times the
weight, round), LayerNorm in fp32 rounded once, the rotation as `rope_triton` (`rotate_pair`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.norm_triton import load_row
from glm53.kernels.rope_triton import rotate_pair
from glm53.kernels.row_parts import row_source

if TYPE_CHECKING:  # kv_rows dispatches here
    from glm53.kernels.kv_rows import CacheRow


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
def _store_row(t, page, off, x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, cache_ptr, W, stride_x, stride_c, stride_cp,
               stride_co, eps, stride_xp, NORM_D: tl.constexpr, ROPE_LO: tl.constexpr, HALF: tl.constexpr,
               LAYER: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, XPARTS: tl.constexpr):
    """Token t's row finished and stored at (page, off)."""
    # XPARTS > 1: x is a sum not taken yet (`norm_triton.load_row`), taken in the cache's dtype
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
    tl.store(cache_ptr + page * stride_cp + off * stride_co + d, v.to(dt), mask=inrow)


@triton.jit
def _store_rows_kernel(x_ptr, w_ptr, b_ptr, cache_ptr, W, stride_x, stride_cp, stride_co, eps, stride_xp,
                       x2_ptr, w2_ptr, b2_ptr, cache2_ptr, W2, stride_x2, stride_cp2, stride_co2, eps2, stride_xp2,
                       cos_ptr, sin_ptr, page_ptr, off_ptr, stride_c, HALF: tl.constexpr,
                       NORM_D: tl.constexpr, ROPE_LO: tl.constexpr, LAYER: tl.constexpr, INTERLEAVE: tl.constexpr,
                       BLOCK: tl.constexpr, XPARTS: tl.constexpr, NORM_D2: tl.constexpr, ROPE_LO2: tl.constexpr,
                       LAYER2: tl.constexpr, INTERLEAVE2: tl.constexpr, BLOCK2: tl.constexpr, XPARTS2: tl.constexpr,
                       TWO: tl.constexpr = False, PDL: tl.constexpr = False):
    # program (t, j): token t's row of job j; the second job's arguments are read only with TWO
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    t = tl.program_id(0).to(tl.int64)
    job = tl.program_id(1)
    page = tl.load(page_ptr + t).to(tl.int64)
    off = tl.load(off_ptr + t).to(tl.int64)
    if job == 0:
        _store_row(t, page, off, x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, cache_ptr, W, stride_x, stride_c, stride_cp,
                   stride_co, eps, stride_xp, NORM_D, ROPE_LO, HALF, LAYER, INTERLEAVE, BLOCK, XPARTS)
    if TWO:
        if job == 1:
            _store_row(t, page, off, x2_ptr, w2_ptr, b2_ptr, cos_ptr, sin_ptr, cache2_ptr, W2, stride_x2, stride_c,
                       stride_cp2, stride_co2, eps2, stride_xp2, NORM_D2, ROPE_LO2, HALF, LAYER2, INTERLEAVE2, BLOCK2,
                       XPARTS2)


def _job(row: CacheRow, n: int, half: int) -> tuple[tuple, dict]:
    """A row's runtime arguments and constexprs (suffix-free names), its shapes checked."""
    x, cache, weight, bias, norm_d = row.x, row.cache, row.weight, row.bias, row.norm_d
    W = x.shape[1]
    src, x_parts, stride_xp, _ = row_source(x)
    assert x.shape[0] == n and cache.dim() == 3 and cache.shape[2] == W and cache.stride(2) == 1
    assert src.stride(1) == 1 and cache.dtype == x.dtype, (cache.dtype, x.dtype)
    assert weight.shape == (norm_d,) and (bias is None or bias.shape == (norm_d,)) and 0 < norm_d <= W
    assert row.rope_lo + 2 * half <= W
    args = (src, weight, weight if bias is None else bias, cache, W, src.stride(0), cache.stride(0), cache.stride(1),
            row.eps, stride_xp)
    consts = dict(NORM_D=norm_d, ROPE_LO=row.rope_lo, LAYER=bias is not None, INTERLEAVE=row.interleave,
                  BLOCK=triton.next_power_of_2(W), XPARTS=x_parts)
    return args, consts


def store_rows_triton(rows: list[CacheRow], coords: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """`kv_rows.store_rows` of one or two rows a token in one launch; x may be a `RowParts` (its
    sum taken here)."""
    assert 1 <= len(rows) <= 2, len(rows)
    page, off = coords
    N, half = page.shape[0], cos.shape[1]
    assert cos.shape == sin.shape == (N, half) and cos.stride() == sin.stride() and off.shape == (N,)
    jobs = [_job(r, N, half) for r in rows]
    if N == 0:
        return
    (a, ca), (b, cb) = jobs[0], jobs[-1]
    block = max(ca["BLOCK"], cb["BLOCK"])
    _store_rows_kernel[(N, len(rows))](
        *a, *b, cos, sin, page, off, cos.stride(0), HALF=half, **ca, **{k + "2": v for k, v in cb.items()},
        TWO=len(rows) == 2, num_warps=max(1, min(8, block // 256)), **early_args(),
    )

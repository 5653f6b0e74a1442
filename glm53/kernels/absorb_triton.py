"""`absorb.absorbed_query` as one Triton kernel.

Grid: (head, column block, row block). A program multiplies BM rows of one head's q_nope by a
[nope, BN] slice of its W_UK (fp32 accumulation, one rounding to the dtype); the first column
block's programs also rotate the head's q_pe (`rope_triton.rotate_pair`: the rope kernel's
roundings)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, triton_interpreting
from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.rope_triton import rotate_pair

BM = 16  # tl.dot's least rows; a decode batch's rows padded to it


@triton.jit(do_not_specialize=["N"])
def _absorbed_query_kernel(q_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, N,
                           stride_qn, stride_qh, stride_wh, stride_wk, stride_on, stride_oh, stride_c,
                           NOPE: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
                           PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    h = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    rows = tl.program_id(2) * BM + tl.arange(0, BM)
    rm = rows < N
    r64 = rows.to(tl.int64)
    cols = nb * BN + tl.arange(0, BN)
    cm = cols < R
    qh = q_ptr + h * stride_qh + r64[:, None] * stride_qn  # [BM, 1]: the rows' q of head h
    wh = w_ptr + h * stride_wh + cols[None, :]
    k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, NOPE, BK):
        km = (k0 + k) < NOPE
        a = tl.load(qh + (k0 + k)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(wh + (k0 + k)[:, None] * stride_wk, mask=km[:, None] & cm[None, :], other=0.0)
        if DOT_F32:  # the interpreter: widen both (exact) and multiply in fp32
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    dt = out_ptr.dtype.element_ty
    oh = out_ptr + r64[:, None] * stride_on + h * stride_oh
    tl.store(oh + cols[None, :], acc.to(dt), mask=rm[:, None] & cm[None, :])
    if nb == 0:  # the rotated q_pe after the absorbed columns
        j = tl.arange(0, HALF)
        pe = qh + NOPE
        if INTERLEAVE:  # pairs (2j, 2j + 1)
            x1 = tl.load(pe + 2 * j[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
            x2 = tl.load(pe + 2 * j[None, :] + 1, mask=rm[:, None], other=0.0).to(tl.float32)
        else:  # halves
            x1 = tl.load(pe + j[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
            x2 = tl.load(pe + HALF + j[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        cs = r64[:, None] * stride_c + j[None, :]
        c = tl.load(cos_ptr + cs, mask=rm[:, None], other=0.0).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + cs, mask=rm[:, None], other=0.0).to(dt).to(tl.float32)
        tl.store(oh + R + j[None, :], rotate_pair(x1, x2, c, s, dt), mask=rm[:, None])
        tl.store(oh + R + HALF + j[None, :], rotate_pair(x2, x1, c, -s, dt), mask=rm[:, None])


def absorbed_query_triton(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          interleave: bool) -> torch.Tensor:
    n, h, d = q.shape
    _, nope, r = w_uk.shape
    half = (d - nope) // 2
    assert w_uk.shape[0] == h and q.stride(2) == 1 and w_uk.stride(2) == 1, (q.shape, q.stride(), w_uk.shape)
    assert cos.shape == sin.shape == (n, half) and cos.stride() == sin.stride() and half & (half - 1) == 0
    out = torch.empty(n, h, r + 2 * half, dtype=q.dtype, device=q.device)
    if n:
        interp = triton_interpreting()
        bn = min(128, triton.next_power_of_2(r))
        bk = min(64, triton.next_power_of_2(nope))
        _absorbed_query_kernel[(h, triton.cdiv(r, bn), triton.cdiv(n, BM))](
            q, w_uk, cos, sin, out, n, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1),
            out.stride(0), out.stride(1), cos.stride(0), NOPE=nope, R=r, HALF=half, INTERLEAVE=interleave,
            BM=BM, BN=bn, BK=bk, DOT_F32=interp, PRECISION=dot_precision(torch.float32 if interp else q.dtype),
            num_warps=4, **early_args())
    return out

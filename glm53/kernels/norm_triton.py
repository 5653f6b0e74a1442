"""RMSNorm as one Triton kernel: one program per row, the row in registers.

The torch reference (`norm.rms_norm`) is seven or eight elementwise and reduction kernels; a
decode step runs ~17 norms, so on a launch-bound step this is ~120 launches fewer. The kernel
keeps the reference's order of operations and roundings: normalise in fp32, round to x's dtype,
then multiply by the weight in the promoted dtype (round(float(w) * float(n)))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.row_parts import RowParts, row_source


def added(add: torch.Tensor | RowParts | None, x: torch.Tensor) -> tuple[int, int]:
    """(parts, the stride between them) of a norm's `add`: a tensor is one part, none is (0, 0);
    asserting either one's shape, dtype and unit last stride against x's."""
    if add is None:
        return 0, 0
    assert add.shape == x.shape and add.dtype == x.dtype, (add.shape, add.dtype, x.shape, x.dtype)
    if isinstance(add, RowParts):
        return add.parts.shape[0], add.parts.stride(0)
    assert add.stride(-1) == 1, add.stride()
    return 1, 0


@triton.jit
def load_row(x_ptr, off, mask, stride_xp, XPARTS: tl.constexpr, DT: tl.constexpr):
    """Rows' values at `off` in DT: a tensor's (XPARTS 1: as loaded), or the sum of XPARTS parts
    `stride_xp` apart (`row_parts.row_source`), summed as the parts' own launch would sum them:
    fp32, part 0 first, rounded to DT once."""
    x = tl.load(x_ptr + off, mask=mask, other=0.0)
    if XPARTS > 1:
        x = x.to(tl.float32)
        for p in tl.static_range(1, XPARTS):
            x += tl.load(x_ptr + p * stride_xp + off, mask=mask, other=0.0).to(tl.float32)
    return x.to(DT)


@triton.jit
def load_residual_sum(x_ptr, a_ptr, s_ptr, x_off, a_off, s_off, mask, ADD: tl.constexpr, stride_ap,
                      PARTS: tl.constexpr, stride_xp, XPARTS: tl.constexpr, DT: tl.constexpr):
    """x at `x_off` (`load_row`: XPARTS parts `stride_xp` apart, in the rows' dtype DT); with ADD
    the residual sum x + a instead, rounded to DT as torch's add rounds it, and written to s (the
    norms that take the add before them: here and `fp8_act`). a is PARTS parts `stride_ap` apart
    (`added`: one for a tensor, more for a `row_parts.RowParts`)."""
    x = load_row(x_ptr, x_off, mask, stride_xp, XPARTS, DT)
    if ADD:
        a = load_row(a_ptr, a_off, mask, stride_ap, PARTS, DT)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(DT)
        tl.store(s_ptr + s_off, x, mask=mask)
    return x


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, a_ptr, s_ptr, D, stride_x, stride_o, stride_a, stride_s, stride_ap, eps,
                     stride_xp, BLOCK_D: tl.constexpr, ADD: tl.constexpr, PARTS: tl.constexpr, XPARTS: tl.constexpr,
                     DT: tl.constexpr, PDL: tl.constexpr = False):
    """ADD: the residual sum s = x + a (rounded to x's dtype DT, as torch's add) is written to s and
    normalised: one pass where an add and a norm read the sum twice. XPARTS > 1: x is a sum not
    taken yet (`load_row`)."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = load_residual_sum(x_ptr, a_ptr, s_ptr, row * stride_x + d, row * stride_a + d, row * stride_s + d, mask, ADD,
                          stride_ap, PARTS, stride_xp, XPARTS, DT)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    n = (xf * rstd).to(DT).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (w * n).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor | RowParts, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                    add: torch.Tensor | RowParts | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] with a unit last stride (rows may be strided, e.g. a column slice), or a 2-d
    `RowParts` (its sum taken here); weight [D]. Returns (or writes `out`, which may be x itself)
    in the dtype torch's promotion gives. With `add` (x's shape and dtype, or a `RowParts` of them
    for 2-d x): (s = x + add, the norm of s)."""
    D = x.shape[-1]
    src, x_parts, stride_xp, dt = row_source(x)
    assert weight.shape == (D,) and src.stride(-1) == 1, (x.shape, src.stride(), weight.shape)
    rows = src.view(-1, D) if src.dim() != 2 else src
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=src.device)
    assert out.shape == x.shape and out.dtype == dtype and out.stride(-1) == 1
    o = out.view(-1, D) if out.dim() != 2 else out
    a = s = o  # unused without `add`
    n_parts, stride_ap = added(add, x)
    if add is not None:
        a = add.parts[0] if isinstance(add, RowParts) else add.reshape(-1, D)
        s = torch.empty(rows.shape, dtype=x.dtype, device=src.device)
    if rows.shape[0]:
        BLOCK_D = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, o, a, s, D, rows.stride(0), o.stride(0), a.stride(0), s.stride(0), stride_ap, eps, stride_xp,
            BLOCK_D=BLOCK_D, ADD=add is not None, PARTS=n_parts, XPARTS=x_parts, DT=dt,
            num_warps=max(1, min(16, BLOCK_D // 256)), **early_args())
    return out if add is None else (s.view(x.shape), out)


@triton.jit
def _sum_rms_norm_kernel(parts_ptr, acc_ptr, w_ptr, out_ptr, P, D, stride_pp, stride_pn, stride_a, stride_o, eps,
                         BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """One row: s = acc + parts[0] + … + parts[P − 1] in fp32, in that order (each addend widened
    exactly), then `_rms_norm_kernel`'s arithmetic on the fp32 row."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    if ACC:
        s = tl.load(acc_ptr + row * stride_a + d, mask=mask, other=0.0).to(tl.float32)
        first = 0
    else:
        s = tl.load(parts_ptr + row * stride_pn + d, mask=mask, other=0.0).to(tl.float32)
        first = 1
    for p in range(first, P):
        s += tl.load(parts_ptr + p * stride_pp + row * stride_pn + d, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (w * (s * rstd)).to(out_ptr.dtype.element_ty), mask=mask)


def sum_rms_norm_triton(parts: torch.Tensor, acc: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        dtype: torch.dtype) -> torch.Tensor:
    P, N, D = parts.shape
    assert parts.stride(2) == 1 and weight.shape == (D,) and (acc is None or (acc.shape == (N, D) and acc.stride(1) == 1))
    out = torch.empty(N, D, dtype=dtype, device=parts.device)
    if N:
        BLOCK_D = triton.next_power_of_2(D)
        _sum_rms_norm_kernel[(N,)](parts, parts if acc is None else acc, weight, out, P, D, parts.stride(0),
                                   parts.stride(1), 0 if acc is None else acc.stride(0), out.stride(0), eps,
                                   BLOCK_D=BLOCK_D, ACC=acc is not None, num_warps=max(1, min(16, BLOCK_D // 256)))
    return out

"""RMSNorm as one Triton kernel: one program per row, the row in registers.

The torch reference (`norm.rms_norm`) is seven or eight elementwise and reduction kernels; a
decode step runs ~17 norms, so on a launch-bound step this is ~120 launches fewer. The kernel
keeps the reference's order of operations and roundings: normalise in fp32, round to x's dtype,
then multiply by the weight in the promoted dtype (round(float(w) * float(n)))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    n = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (w * n).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] with a unit last stride (rows may be strided, e.g. a column slice); weight [D].
    Returns (or writes `out`, which may be x itself) in the dtype torch's promotion gives."""
    D = x.shape[-1]
    assert weight.shape == (D,) and x.stride(-1) == 1, (x.shape, x.stride(), weight.shape)
    rows = x.view(-1, D) if x.dim() != 2 else x
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == dtype and out.stride(-1) == 1
    o = out.view(-1, D) if out.dim() != 2 else out
    if rows.shape[0]:
        BLOCK_D = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, o, D, rows.stride(0), o.stride(0), eps, BLOCK_D=BLOCK_D,
                                           num_warps=max(1, min(16, BLOCK_D // 256)))
    return out

"""Rotary embedding as one Triton kernel: a program rotates a block of heads of one token.

The torch reference (`rope.apply_rope`) is ~10 kernels (casts, strided slices, four products,
the sum, the difference and a cat); it runs 14 times in a GLM-5 decode step of 4 layers. The
kernel rounds cos/sin to x's dtype like the reference, then o1 = x1·c − round(x2·s) and
o2 = x2·c + round(x1·s) each as one fma, rounded once (`rotate_pair`); the reference rounds
x1·c and x2·c too. That is what the compiler made of this kernel written with the reference's
four roundings (it contracted the product and the difference; on the H200 identical at 8,192
of 8,192 elements), spelled out so that every kernel rotating a row (`kv_rows_triton`) and the
interpreter round as the served path always has. A program loads its whole rows before
storing, so `out` may be `x` itself (in place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.launch_early import early_args, wait_then_release
from triton.language.extra import libdevice


@triton.jit
def rotate_pair(u, w, c, s, dt: tl.constexpr):
    """u·c − round(w·s) in one fma, rounded to dt: o1 = rotate_pair(x1, x2, c, s), o2 =
    rotate_pair(x2, x1, c, −s); fp32 operands, c and s already rounded to dt."""
    return tl.fma(u, c, -(w * s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def cos_sin(angle, LIBDEVICE: tl.constexpr):
    """cos and sin of fp32 `angle`s as torch's CUDA ops compute them: libdevice's cosf/sinf
    (LIBDEVICE); the interpreter has no libdevice and runs numpy's (`tl.cos`/`tl.sin`)."""
    if LIBDEVICE:
        return libdevice.cos(angle), libdevice.sin(angle)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xn, stride_xh, stride_on, stride_oh, stride_c,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr, PDL: tl.constexpr = False):
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    hm = (h < H)[:, None]
    base = x_ptr + t * stride_xn + h[:, None].to(tl.int64) * stride_xh
    if INTERLEAVE:  # pairs (2j, 2j + 1)
        x1 = tl.load(base + 2 * j[None, :], mask=hm, other=0.0)
        x2 = tl.load(base + 2 * j[None, :] + 1, mask=hm, other=0.0)
    else:  # halves
        x1 = tl.load(base + j[None, :], mask=hm, other=0.0)
        x2 = tl.load(base + HALF + j[None, :], mask=hm, other=0.0)
    dt = x_ptr.dtype.element_ty
    c = tl.load(cos_ptr + t * stride_c + j).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_c + j).to(dt).to(tl.float32)[None, :]
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = rotate_pair(x1, x2, c, s, dt)
    o2 = rotate_pair(x2, x1, c, -s, dt)
    obase = out_ptr + t * stride_on + h[:, None].to(tl.int64) * stride_oh
    tl.store(obase + j[None, :], o1, mask=hm)
    tl.store(obase + HALF + j[None, :], o2, mask=hm)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, R] or [N, H, R] with a unit last stride; cos/sin [N, R/2] fp32. Writes `out`
    (x's shape and dtype, any strides with a unit last one; may be x) or a new tensor."""
    squeeze = x.dim() == 2
    xv = x[:, None] if squeeze else x
    assert xv.dim() == 3 and xv.stride(-1) == 1, (x.shape, x.stride())
    N, H, R = xv.shape
    assert cos.shape == sin.shape == (N, R // 2) and cos.stride() == sin.stride() and cos.stride(1) == 1
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ov = out[:, None] if squeeze else out
    assert ov.shape == xv.shape and out.dtype == x.dtype and ov.stride(-1) == 1
    if N:
        BLOCK_H = min(triton.next_power_of_2(H), 16)
        _rope_kernel[(N, triton.cdiv(H, BLOCK_H))](
            xv, cos, sin, ov, H, xv.stride(0), xv.stride(1), ov.stride(0), ov.stride(1), cos.stride(0),
            HALF=R // 2, BLOCK_H=BLOCK_H, INTERLEAVE=interleave, num_warps=4 if BLOCK_H * R >= 1024 else 1,
            **early_args(),
        )
    return out

"""The Triton kernel of `swiglu.silu_mul`: a program per (BLOCK_M rows, BLOCK_N columns) tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice as ld


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, M, I, stride_g, stride_u, stride_h,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (rows < M)[:, None] & (cols < I)[None, :]
    r64 = rows[:, None].to(tl.int64)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=m, other=0.0).to(tl.float32)
    # the interpreter has no libdevice: numpy's exp there
    e = ld.exp(-g) if LIBDEVICE else tl.exp(-g)
    dt = h_ptr.dtype.element_ty
    s = tl.math.div_rn(g, 1.0 + e).to(dt).to(tl.float32)  # torch's silu, rounded to the dtype
    tl.store(h_ptr + r64 * stride_h + cols[None, :], (s * u).to(dt), mask=m)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, libdevice: bool = True) -> torch.Tensor:
    m, inter = gate.shape
    h = torch.empty((m, inter), dtype=gate.dtype, device=gate.device)
    if m and inter:
        block_m = max(1, min(16, triton.next_power_of_2(m)))
        block_n = max(16, min(1024 // block_m, triton.next_power_of_2(inter)))
        _silu_mul_kernel[(triton.cdiv(m, block_m), triton.cdiv(inter, block_n))](
            gate, up, h, m, inter, gate.stride(0), up.stride(0), h.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, LIBDEVICE=libdevice, num_warps=4)
    return h

"""SwiGLU's elementwise middle, h = silu(gate) · up, in one launch where torch runs two (silu, then
the product). It rounds as those two ops do: silu(g) = g / (1 + exp(−g)) in fp32 (libdevice's expf
and a correctly rounded division, as torch's CUDA kernel computes it), rounded to the dtype, then
the product in fp32, rounded again. `fp8_act.silu_mul_fp8` is the same with h quantized for a w8a8
down product."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.dispatch import triton_interpreting, use_triton


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [m, I] (same dtype and shape; unit last stride, rows may be strided: the halves of
    a fused gate_up product) -> h [m, I] contiguous. Triton where `dispatch.use_triton` says so."""
    if (use_triton(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.stride(1) == 1 and up.stride(1) == 1):
        from glm53.kernels.swiglu_triton import silu_mul_triton

        return silu_mul_triton(gate, up, libdevice=not triton_interpreting())
    return F.silu(gate) * up

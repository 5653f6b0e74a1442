"""fp32 products with a small output width: the MoE router's logits and the DSA indexer's head
gates, y = scale * (x.float() @ W.float()^T). On a decode step torch spends three launches on each
(the cast, cuBLAS's gemv in two kernels, the scale); `linear_f32_triton` is one, where
`dispatch.use_triton` says so and the rows are few (past `TRITON_MAX_ROWS` cuBLAS's fp32 GEMM is
the better kernel). Otherwise the reference, `linear_f32_reference`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.dispatch import use_triton

# Rows up to which the Triton kernel runs: a decode step's tokens (speculative ones included).
TRITON_MAX_ROWS = 64


def linear_f32_reference(x: torch.Tensor, w: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    y = F.linear(x.float(), w.float())
    return y * scale if scale != 1.0 else y


def linear_f32(x: torch.Tensor, w: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * (x @ w^T) in fp32: x [M, K], w [N, K] -> [M, N] fp32 (a new tensor)."""
    if use_triton(x, w) and x.dim() == 2 and x.shape[0] <= TRITON_MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1:
        from glm53.kernels.linear_f32_triton import DTYPES, linear_f32_triton

        if x.dtype in DTYPES and w.dtype in DTYPES:
            return linear_f32_triton(x, w, scale)
    return linear_f32_reference(x, w, scale)

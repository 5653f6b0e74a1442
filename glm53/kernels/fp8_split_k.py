"""Split-K for the block-FP8 products: cutting K into slices of whole 128-wide scale blocks (the
GEMM, `fp8_gemm_triton`, and the FP8 MoE's gate+up kernels, tiles and GEMVs alike), and for the
GEMM its weight check and the sum of the slices' fp32 partials in a fixed order (deterministic)
in one launch (`row_parts`)."""

from __future__ import annotations

import torch
import triton

from glm53.kernels.fp8_quant import FP8, GROUP
from glm53.kernels.row_parts import sum_parts_triton

SB = GROUP  # scale block edge (weights 128×128, activations 1×128)


def check_fp8_weight(w: torch.Tensor, w_scale: torch.Tensor, K: int) -> int:
    """N of a block-FP8 weight w [N, K] e4m3 with its scales [ceil(N/128), ceil(K/128)] fp32 (unit
    column strides), asserting that layout."""
    N, Kw = w.shape
    assert Kw == K, f"x has K={K}, the weight {tuple(w.shape)}"
    assert w.dtype == FP8 and w.stride(1) == 1, (w.dtype, w.stride())
    assert w_scale.shape == (triton.cdiv(N, SB), triton.cdiv(K, SB)) and w_scale.dtype == torch.float32, \
        (tuple(w_scale.shape), w_scale.dtype, "scales must be fp32 [ceil(N/128), ceil(K/128)]")
    assert w_scale.stride(1) == 1, w_scale.stride()
    return N


def k_splits(K: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) for cutting K into at most `split_k` slices of whole scale blocks, none
    empty."""
    k_blocks = triton.cdiv(K, SB)
    k_per_split = triton.cdiv(k_blocks, max(1, min(split_k, k_blocks))) * SB
    return triton.cdiv(K, k_per_split), k_per_split


def sum_splits(parts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """parts [SPLIT, M, N] fp32 -> their sum in out_dtype, split 0 first, then 1, ... (a fixed
    order: deterministic), in one launch where a torch sum and a cast take two (`row_parts`)."""
    return sum_parts_triton(parts, out_dtype)

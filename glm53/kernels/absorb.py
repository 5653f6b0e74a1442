"""MLA's absorbed query at decode sizes in one launch.

The absorbed form (docs/ARCHITECTURE.md, "MLA") folds kv_b_proj's W_UK into the query, per head h:
q_all[t, h] = [q_nope[t, h] · W_UK[h] | rope(q_pe[t, h])], W_UK [h, nope, r]. The torch path is
a batched matmul and the rope kernel, two small launches at a few tokens; `absorb_triton` does
both in one (a program per head, column block and row block; the rotation in the first column
block's programs). It runs on CUDA up to `MAX_TOKENS` rows; larger batches keep cuBLAS's batched
GEMM, which reuses each head's weights across the rows better. The product accumulates in fp32
and rounds once to the dtype, as cuBLAS does (the sums run in another order: a unit in the last
place here and there); the rotation is the rope kernel's, bit for bit.

The output side (o_lat · W_UVᵀ per head, then o_proj's quantization) stays a batched matmul:
the same kind of kernel with the quantization in its epilogue was measured slower in the decode
step (benchmarks/history, 2026-12-04, "Fewer small launches").
"""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import use_triton
from glm53.kernels.rope import apply_rope

MAX_TOKENS = 16


def absorbed_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   interleave: bool) -> torch.Tensor:
    """q [n, h, nope + rope] (unit last stride; rows may be strided), w_uk [h, nope, r] (unit
    last stride), cos/sin [n, rope / 2] fp32 -> q_all [n, h, r + rope] in q's dtype."""
    fits = q.shape[0] <= MAX_TOKENS and q.stride(-1) == 1 and w_uk.stride(-1) == 1 and cos.stride(-1) == 1
    if fits and use_triton(q, w_uk):
        from glm53.kernels.absorb_triton import absorbed_query_triton

        return absorbed_query_triton(q, w_uk, cos, sin, interleave)
    return absorbed_query_reference(q, w_uk, cos, sin, interleave)


def absorbed_query_reference(q, w_uk, cos, sin, interleave: bool) -> torch.Tensor:
    n, h, _ = q.shape
    nope, r = w_uk.shape[1:]
    q_all = torch.empty(n, h, r + q.shape[2] - nope, dtype=q.dtype, device=q.device)
    torch.bmm(q[..., :nope].transpose(0, 1), w_uk, out=q_all[..., :r].transpose(0, 1))
    apply_rope(q[..., nope:], cos, sin, interleave, out=q_all[..., r:])
    return q_all

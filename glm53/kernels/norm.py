"""Normalisations: RMSNorm (model, MLA latents; `add_rms_norm` with the residual add before it;
`sum_rms_norm` of a sum of products, the draft's context projection) and LayerNorm with bias
(indexer keys).

`rms_norm` runs the Triton kernel (`norm_triton.py`) where `dispatch.use_triton` says so and the
weight is one vector; the reference (`rms_norm_reference`) otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.dispatch import use_triton
from glm53.kernels.row_parts import RowParts, take


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, cast back, then scale (the reference's order of operations).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor | RowParts, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim. `out` (optional, may be x itself) receives the result. x may be
    a 2-d sum not taken yet (`row_parts`): the kernel takes it."""
    rows = x.parts if isinstance(x, RowParts) else x
    if use_triton(rows, weight) and weight.dim() == 1 and rows.stride(-1) == 1:
        from glm53.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, out)
    x = take(x)
    y = rms_norm_reference(x, weight, eps)
    return y if out is None else out.copy_(y)


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | RowParts, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s = x + add, RMSNorm(s)): a residual add and the norm after it, in one kernel where
    `dispatch.use_triton` says so (bit-identical to the two ops: the sum is rounded to x's dtype
    before the norm reads it). `add` may be a sum not taken yet (`row_parts`): the kernel takes it."""
    a = add.parts if isinstance(add, RowParts) else add
    if use_triton(x, a, weight) and weight.dim() == 1 and x.stride(-1) == 1 and a.stride(-1) == 1 \
            and add.shape == x.shape and add.dtype == x.dtype and (a is add or x.dim() == 2):
        from glm53.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, add=add)
    s = x + take(add)
    return s, rms_norm(s, weight, eps)


def sum_rms_norm(parts: torch.Tensor, acc: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm(acc + Σ_p parts[p]) in `dtype`: parts [P, N, D] (P ≥ 1 without acc), acc [N, D]
    fp32 or None, the sum in fp32 in that order; one kernel where `dispatch.use_triton` says so
    (the same values as the adds, `rms_norm` in fp32 and the cast: the sum is exact to fp32 as
    the ops round it, and the norm of an fp32 row rounds nothing before the weight)."""
    if use_triton(parts, weight) and weight.dim() == 1 and parts.stride(-1) == 1 and (acc is None or acc.stride(-1) == 1):
        from glm53.kernels.norm_triton import sum_rms_norm_triton

        return sum_rms_norm_triton(parts, acc, weight, eps, dtype)
    return sum_rms_norm_reference(parts, acc, weight, eps, dtype)


def sum_rms_norm_reference(parts: torch.Tensor, acc: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           dtype: torch.dtype) -> torch.Tensor:
    s = acc
    for p in parts:
        s = p.float() if s is None else s + p.float()
    return rms_norm(s, weight, eps).to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)

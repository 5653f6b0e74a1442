"""Linears that read one input, computed as one product.

Several projections of a layer take the same input: q_a, kv_a and the indexer's wk the normed
hidden state; q_b and the indexer's wq_b q_a's normed output; an MLP's gate and up its input.
`FusedLinear.of` stacks their weights in one tensor (rows; under block-FP8 each member's rows
padded to whole 128-row blocks, so every member keeps its own scale rows) and makes each member's
parameters views of it. Checkpoint names, shard rules and the loader stay as they are; the fused
product costs one launch where the members cost one each, and under block-FP8 one activation
quantization (prefill) and one split-K reduction (decode) instead of one per member.

Each output column is its own dot product over the same input, so a member's slice of the fused
output is that member's product; only the GEMM's accumulation order may differ (on CPU the
block-FP8 reference multiplies in fp32).

A MoE layer's shared expert, where it has one routed expert's per-rank shapes (GLM-5 at tp = 8:
[256, 6144] and [6144, 256]), joins the routed experts' stacks as one more expert
(`append_to_stack_`, `moe.Experts.absorb_`): every token routes to it at weight 1, and one fused
MoE launch computes both, where the shared SwiGLU cost three products, a SwiGLU and an add.

Fuse after the model is on its device (`fuse_projections_`: the runner does it before capturing
graphs): moving a module afterwards would give the members new storage and leave the fused weight
behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from glm53.kernels.fp8_act import Fp8Rows
from glm53.kernels.fp8_gemm import fp8_gemm, fp8_gemm_rows, takes_fp8_rows
from glm53.kernels.fp8_quant import GROUP
from glm53.kernels.row_parts import RowParts
from glm53.models.sharding import shard_of


@dataclass
class FusedLinear:
    """The members' weights stacked on rows, `weight` [Σ rows, K] (FP8: `scale` [Σ rows / 128,
    ceil(K / 128)]); member i's output is columns [starts[i], starts[i] + widths[i]) of the product."""

    weight: torch.Tensor = field(repr=False)
    scale: torch.Tensor | None = field(repr=False)
    starts: tuple[int, ...]
    widths: tuple[int, ...]
    dtype: torch.dtype  # the output's (the members' `dtype`)

    @classmethod
    def of(cls, linears: list[nn.Module]) -> "FusedLinear | None":
        """Fuses `linears` (the `layers.Linear` family, same input width, all block-FP8 or all in
        one dtype) in place; None, touching nothing, when they cannot share one product. A
        trainable member is never fused: the product of the stacked copy would cut its gradient."""
        if len(linears) < 2 or any(m.weight.requires_grad for m in linears):
            return None
        first = linears[0]
        fp8 = first.fp8
        k = first.weight.shape[1]
        if any(m.fp8 != fp8 or m.weight.dtype != first.weight.dtype or m.dtype != first.dtype
               or m.weight.shape[1] != k or m.weight.device != first.weight.device for m in linears):
            return None
        pad = GROUP if fp8 else 1
        widths = tuple(m.weight.shape[0] for m in linears)
        rows = [-(-n // pad) * pad for n in widths]
        starts = tuple(sum(rows[:i]) for i in range(len(rows)))
        dev = first.weight.device
        weight = torch.zeros(sum(rows), k, dtype=first.weight.dtype, device=dev)
        scale = None
        if fp8:
            kb = first.weight_scale_inv.shape[1]
            scale = torch.ones(sum(rows) // GROUP, kb, dtype=torch.float32, device=dev)
        for m, a, n in zip(linears, starts, widths):
            weight[a : a + n].copy_(m.weight)
            m.weight = view_param(weight[a : a + n], m.weight)
            if fp8:
                s = m.weight_scale_inv
                if s.shape != (-(-n // GROUP), kb):
                    raise ValueError(f"block-FP8 scales {tuple(s.shape)} for a [{n}, {k}] weight: not 128×128 blocks")
                b = a // GROUP
                scale[b : b + s.shape[0]].copy_(s)
                m.weight_scale_inv = view_param(scale[b : b + s.shape[0]], s)
        return cls(weight, scale, starts, widths, first.dtype)

    def takes_fp8_rows(self, m: int) -> bool:
        """Whether the product of m rows reads its input quantized (`fp8_act`)."""
        return takes_fp8_rows(m, *self.weight.shape, self.weight.device, self.scale is not None)

    def __call__(self, x: torch.Tensor | Fp8Rows, keep_parts: bool = False) -> list[torch.Tensor | RowParts]:
        """Each member's product x @ W_i^T (no communication), as views of one output; x dense, or
        its rows a producer quantized when `takes_fp8_rows`. `keep_parts`: a split-K product's
        sum may come back not taken yet, each member's columns of it (`row_parts`), for readers
        that take it (norms, cache-row stores)."""
        if isinstance(x, Fp8Rows):
            y = fp8_gemm_rows(x, self.weight, self.scale, self.dtype, keep_parts=keep_parts)
        elif self.scale is not None:
            y = fp8_gemm(x.to(self.dtype), self.weight, self.scale, self.dtype)
        else:
            y = F.linear(x.to(self.weight.dtype), self.weight)
        if isinstance(y, RowParts):
            return [RowParts(y.parts[..., a : a + n], y.dtype) for a, n in zip(self.starts, self.widths)]
        return [y[..., a : a + n] for a, n in zip(self.starts, self.widths)]


def view_param(view: torch.Tensor, old: nn.Parameter) -> nn.Parameter:
    """`view` as a frozen parameter with `old`'s shard rule (the loader's and `plan`'s view of it)."""
    p = nn.Parameter(view, requires_grad=False)
    p.shard = shard_of(old)
    return p


def append_to_stack_(stack_owner: nn.Module, name: str, owner: nn.Module, member: str) -> torch.Tensor:
    """One [E + 1, ...] tensor holding `stack_owner.<name>` [E, ...] and then `owner.<member>`
    [...]; both attributes become parameter views of it (shard rules kept, so names, the loader
    and `plan`'s byte count are unchanged). Returns the new stack."""
    stack, one = getattr(stack_owner, name), getattr(owner, member)
    E = stack.shape[0]
    out = torch.empty((E + 1, *stack.shape[1:]), dtype=stack.dtype, device=stack.device)
    out[:E].copy_(stack)
    out[E].copy_(one)
    setattr(stack_owner, name, view_param(out[:E], stack))
    setattr(owner, member, view_param(out[E], one))
    return out


def padding_bytes(module: nn.Module) -> int:
    """Bytes the fused weights in `module` hold beyond their members' parameters: the rows that pad
    block-FP8 members to whole 128-row blocks (what `glm53-serve plan` adds to the parameters)."""
    total = 0
    for m in module.modules():
        for f in vars(m).values():
            if isinstance(f, FusedLinear):
                total += (f.weight.shape[0] - sum(f.widths)) * f.weight.shape[1] * f.weight.element_size()
    return total


def fuse_projections_(module: nn.Module) -> int:
    """Fuses every layer of `module` that can (each submodule's `fuse_projections_`); returns how
    many fused products it made."""
    return sum(m.fuse_projections_() for m in module.modules() if hasattr(m, "fuse_projections_"))

"""Shard rules: how a model parameter relates to its checkpoint tensor.

Every parameter carries its rule as the attribute `shard` (set by `layers.param`); the loader and
`checkpoint_tensors` read the rule and stay generic. A rule either replicates the tensor (every
rank holds it whole) or cuts one checkpoint dimension into `size` equal parts, of which this rank
holds part `rank`. For a stacked routed-expert parameter [E_local, ...] the rule describes one
expert's checkpoint tensor, i.e. the parameter's row `[i]`, and `experts` says which checkpoint
experts the rows are (expert parallelism: a contiguous range of the `n_experts`; row i is expert
`experts.start + i`): the loader reads only those experts' tensors.

A block-FP8 weight's `weight_scale_inv` [ceil(N/128), ceil(K/128)] carries its own rule, the
weight's (same dimension, rank and size) applied to the scale tensor: when each rank's part of
the weight is whole 128-blocks (checked when the layer takes its FP8 form, `layers.fp8_pair`),
the equal parts of the scale tensor are exactly the blocks of the weight's parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    dim: int | None = None  # checkpoint dimension that is split; None: replicated
    rank: int = 0
    size: int = 1
    # Stacked routed experts only: the checkpoint expert ids of the parameter's rows, out of
    # `n_experts` in the checkpoint. None for every other parameter.
    experts: range | None = None
    n_experts: int = 0

    def holds_expert(self, e: int) -> bool:
        """Whether this rank's stacked parameter has a row for checkpoint expert `e`."""
        return self.experts is None or e in self.experts

    def expert_row(self, e: int) -> int:
        """The parameter row of checkpoint expert `e` (which this rank holds)."""
        return e if self.experts is None else e - self.experts.start

    @property
    def replicated(self) -> bool:
        return self.dim is None or self.size == 1

    def local_shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.replicated:
            return tuple(full)
        out = list(full)
        out[self.dim] = full[self.dim] // self.size
        return tuple(out)

    def full_shape(self, local: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """The checkpoint shape of a tensor whose local part has shape `local`."""
        out = list(local)
        if not self.replicated:
            out[self.dim] *= self.size
        return tuple(out)

    def index(self, full: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part this rank reads of a checkpoint tensor of shape `full` (explicit start/stop on
        every dimension), or None for the whole tensor."""
        if self.replicated:
            return None
        n = full[self.dim] // self.size
        idx = [slice(0, d) for d in full]
        idx[self.dim] = slice(self.rank * n, (self.rank + 1) * n)
        return tuple(idx)


REPLICATED = Shard()


def shard_of(p: torch.Tensor) -> Shard:
    """A parameter's rule; a parameter built without one is replicated."""
    return getattr(p, "shard", REPLICATED)

"""Expert parallelism (EP): which routed experts, and which part of their intermediate width, each
rank of a tensor-parallel group holds. A pure function of the config and (tp, ep, rank), shared by
the model (`moe.Experts` builds its stacks from it, and their shard rules tell the loader what
to read) and by the memory planner (`expert_placement(...).shapes()`: a rank's expert bytes).

Layout (docs/ARCHITECTURE.md, "Expert parallelism"): the `tp` ranks of a stage form `ep` expert
groups of `m = tp / ep` consecutive ranks. Group g = rank // m holds the contiguous expert ids
[g·E/ep, (g+1)·E/ep); inside the group every expert's intermediate width is cut into m equal
parts, rank r holding part r % m (gate/up rows, down columns: today's tensor-parallel rule, within
the group). So ep = 1 is the tensor-parallel MoE (every rank holds all E experts at 1/tp of their
width), ep = tp gives every rank E/tp whole experts, and 1 < ep < tp is both at once. The
attention, the router and the shared experts do not depend on ep.

The exchange of tokens between the groups is `ep_dispatch.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from glm53.models.config import ConfigError, GlmConfig

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertPlacement:
    """What one rank holds of every MoE layer's routed experts (`expert_placement`)."""

    tp: int
    ep: int
    rank: int  # this rank's place in the tensor-parallel group
    experts: range  # checkpoint expert ids held, contiguous
    n_experts: int  # the model's routed experts (n_routed_experts)
    width_part: int  # which part of each held expert's intermediate width: rank % width_parts
    width_parts: int  # m = tp / ep: ranks that share an expert range, each a part of the width
    intermediate: int  # this rank's part of moe_intermediate_size
    hidden: int

    @property
    def group(self) -> int:
        """The expert group (rank // m): the ranks [group·m, (group+1)·m) hold the same experts."""
        return self.rank // self.width_parts

    @property
    def experts_per_group(self) -> int:
        return self.n_experts // self.ep

    @property
    def gate_up_shape(self) -> tuple[int, int, int]:
        """Each of the gate_proj and up_proj stacks: [held experts, intermediate part, hidden]."""
        return (len(self.experts), self.intermediate, self.hidden)

    @property
    def down_shape(self) -> tuple[int, int, int]:
        """The down_proj stack: [held experts, hidden, intermediate part]."""
        return (len(self.experts), self.hidden, self.intermediate)

    def shapes(self, block: int | None = None) -> dict[str, tuple[int, ...]]:
        """Every routed-expert parameter of one MoE layer on this rank, by its model name
        (`gate_proj`, `up_proj`, `down_proj`) and local shape; with `block` (a block-FP8
        checkpoint whose experts are kept FP8, 128 for GLM-5-FP8) also the fp32 scale stacks
        `<proj>_scale_inv` [held experts, ceil(rows/block), ceil(cols/block)]."""
        out: dict[str, tuple[int, ...]] = {}
        for proj in EXPERT_PROJS:
            shape = self.down_shape if proj == "down_proj" else self.gate_up_shape
            out[proj] = shape
            if block is not None:
                e, rows, cols = shape
                out[proj + "_scale_inv"] = (e, -(-rows // block), -(-cols // block))
        return out


def check_ep(cfg: GlmConfig, tp: int, ep: int) -> None:
    """Raises `ConfigError` naming what `ep` expert groups of a `tp`-rank group cannot split: ep
    must divide tp, and (when the model has MoE layers) the routed experts into ep ranges and
    their intermediate width into tp / ep parts."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError(f"expert_parallel_size: must be an integer >= 1, got {ep!r}")
    if tp % ep:
        raise ConfigError(f"expert_parallel_size: ep={ep} does not divide tensor_parallel_size={tp} (the expert "
                          f"groups are ep sets of tp / ep ranks of the tensor-parallel group)")
    if not any(t == "sparse" for t in cfg.mlp_layer_types):
        return
    if cfg.n_routed_experts % ep:
        raise ConfigError(f"n_routed_experts: {cfg.n_routed_experts} is not divisible by expert_parallel_size={ep}")
    m = tp // ep
    if cfg.moe_intermediate_size % m:
        by = f"tensor_parallel_size={tp}" if ep == 1 else \
            f"tensor_parallel_size / expert_parallel_size = {tp} / {ep} = {m}"
        raise ConfigError(f"moe_intermediate_size: {cfg.moe_intermediate_size} is not divisible by {by}")


def expert_placement(cfg: GlmConfig, tp: int, ep: int, rank: int) -> ExpertPlacement:
    """The routed experts (ids and shapes) that rank `rank` of a `tp`-rank group with `ep` expert
    groups holds in every MoE layer (module docstring). `ConfigError` names what does not split."""
    check_ep(cfg, tp, ep)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in [0, {tp})")
    m = tp // ep
    per = cfg.n_routed_experts // ep
    group = rank // m
    return ExpertPlacement(
        tp=tp, ep=ep, rank=rank, experts=range(group * per, (group + 1) * per), n_experts=cfg.n_routed_experts,
        width_part=rank % m, width_parts=m, intermediate=cfg.moe_intermediate_size // m, hidden=cfg.hidden_size,
    )

"""A GLM-5 MoE layer: the replicated router (`Gate`), this rank's routed experts stacked per
layer (`Experts`; block-FP8 where the checkpoint stores them so) and the layer (`MoE`) that routes,
runs the fused experts kernel, adds the shared expert and all-reduces once. Where the shared expert
has one routed expert's per-rank shapes it is held as the stacks' last expert (`Experts.absorb_`)
and the one kernel computes both; with ep > 1 the routed tokens travel by all-to-all
(`ep_dispatch`)."""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels.dispatch import triton_interpreting
from glm53.kernels.fp8_act import Fp8Rows
from glm53.kernels.moe import moe_experts, route, router_logits
from glm53.kernels.moe_fp8 import moe_experts_fp8, moe_fp8_variant
from glm53.kernels.route_triton import RouterLogits
from glm53.kernels.row_parts import RowParts
from glm53.models.config import GlmConfig
from glm53.models.ep_dispatch import ep_moe
from glm53.models.expert_parallel import expert_placement
from glm53.models.fused import append_to_stack_
from glm53.models.layers import MLP, SCALE_SUFFIX, fp8_pair, param
from glm53.models.parallel import TPGroup
from glm53.models.sharding import Shard


class Gate(nn.Module):
    def __init__(self, cfg: GlmConfig):
        super().__init__()
        # fp32 in every GLM-5 checkpoint. Replicated under TP, so every rank routes every token
        # to the same experts with the same weights.
        self.weight = param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = param(cfg.n_routed_experts, dtype=torch.float32)


class Experts(nn.Module):
    """This rank's routed experts (`expert_parallel.expert_placement`: with ep = 1 all E, else
    its group's contiguous range), stacked [E_local, ...], each cut on its intermediate width
    among the tp / ep ranks that share the range: gate/up split on their output rows, down on
    its input columns. The shard rules describe one expert's checkpoint tensor and carry the
    expert range, so the loader reads only these experts.

    Block-FP8 (`to_fp8`): the three stacks e4m3, each with its scales `<proj>_scale_inv`
    [E_local, ceil(rows/128), ceil(cols/128)] (checkpoint `experts.<e>.<proj>.weight_scale_inv`)."""

    PROJS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg: GlmConfig, dtype: torch.dtype, tp: TPGroup, ep: int = 1):
        super().__init__()
        pl = self.placement = expert_placement(cfg, tp.size, ep, tp.rank)
        span = dict(experts=pl.experts, n_experts=pl.n_experts)
        rows = Shard(0, pl.width_part, pl.width_parts, **span)
        cols = Shard(1, pl.width_part, pl.width_parts, **span)
        self.gate_proj = param(*pl.gate_up_shape, dtype=dtype, shard=rows)
        self.up_proj = param(*pl.gate_up_shape, dtype=dtype, shard=rows)
        self.down_proj = param(*pl.down_shape, dtype=dtype, shard=cols)
        for proj in self.PROJS:
            self.register_parameter(proj + SCALE_SUFFIX, None)
        # After `absorb_`: the stacks with the shared expert as expert `shared_id` (the last), by
        # parameter name; the parameters above are views of their first E experts.
        self.stacks: dict[str, torch.Tensor] = {}
        self.shared_id: int | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor | RouterLogits, ids: torch.Tensor | None,
                x_rows: Fp8Rows | None = None, keep_parts: bool = False) -> torch.Tensor | RowParts:
        """Σ over each row's slots of weight · expert(x) for this rank's experts and width part;
        `ids` [N, k] index the local stacks (`shared_id` too, after `absorb_`); block-FP8 experts may
        take the router's scores not routed yet instead (`weights`, `ids` None). `x_rows`: x
        quantized by its norm (`fp8_act`). `keep_parts`: block-FP8 experts may return the sum not
        taken yet (`row_parts`)."""
        w = {name: self.stacks.get(name, getattr(self, name))
             for name in (*self.PROJS, *(proj + SCALE_SUFFIX for proj in self.PROJS))}
        if self.fp8:
            return moe_experts_fp8(x, weights, ids, w["gate_proj"], w["gate_proj_scale_inv"], w["up_proj"],
                                   w["up_proj_scale_inv"], w["down_proj"], w["down_proj_scale_inv"], x_rows=x_rows,
                                   keep_parts=keep_parts)
        return moe_experts(x, weights, ids, w["gate_proj"], w["up_proj"], w["down_proj"])

    @property
    def fp8(self) -> bool:
        return self.gate_proj_scale_inv is not None

    @property
    def kernel_experts(self) -> int:
        """Experts the fused kernel's stacks hold (the shared one included after `absorb_`)."""
        return self.gate_proj.shape[0] + (self.shared_id is not None)

    def takes_fp8_rows(self, m: int) -> bool:
        """Whether the fused kernel over m tokens reads x quantized (the w8a8 variant, `moe_fp8`)."""
        dev = self.gate_proj.device
        return self.fp8 and m > 0 and (dev.type == "cuda" or triton_interpreting()) and \
            moe_fp8_variant(m, self.down_proj.shape[2]) == "w8a8"

    def absorb_(self, shared: MLP) -> bool:
        """Holds `shared` (this rank's part of the shared expert) as one more expert of the stacks,
        id `shared_id` = E, so one fused launch computes it with the routed ones (`route(shared=E)`
        gives every token that slot at weight 1). False, touching nothing, where its per-rank shapes,
        dtype, device or FP8 form differ from one routed expert's (GLM-5 at tp = 8: 2048 / 8 wide
        both), under expert parallelism (the shared expert is no part of the all-to-all), or when
        trainable."""
        lins = dict(zip(self.PROJS, (shared.gate_proj, shared.up_proj, shared.down_proj)))
        if self.placement.ep > 1 or self.shared_id is not None or shared.gate_up is not None:
            return False
        for proj, lin in lins.items():
            w = getattr(self, proj)
            if (w.requires_grad or lin.weight.requires_grad or lin.fp8 != self.fp8 or lin.weight.shape != w.shape[1:]
                    or lin.weight.dtype != w.dtype or lin.weight.device != w.device):
                return False
            if self.fp8 and lin.weight_scale_inv.shape != getattr(self, proj + SCALE_SUFFIX).shape[1:]:
                return False
        self.shared_id = self.gate_proj.shape[0]
        for proj, lin in lins.items():
            self.stacks[proj] = append_to_stack_(self, proj, lin, "weight")
            if self.fp8:
                self.stacks[proj + SCALE_SUFFIX] = append_to_stack_(self, proj + SCALE_SUFFIX, lin, "weight_scale_inv")
        shared.in_expert_stack = True
        return True

    def to_fp8(self, prefix: str, names: frozenset[str], block: int) -> set[str]:
        """Holds the stacks block-FP8 when the checkpoint stores every expert's three projections
        so (`names` holds the stacked names `<prefix>.<proj>`); otherwise none (the fused kernel
        takes one form for all three: the loader dequantizes any FP8 ones)."""
        stacked = {f"{prefix}.{proj}" for proj in self.PROJS}
        if not stacked <= names:
            return set()
        for proj in self.PROJS:
            q, s = fp8_pair(getattr(self, proj), f"{prefix}.<e>.{proj}.weight", block)
            setattr(self, proj, q)
            setattr(self, proj + SCALE_SUFFIX, s)
        return stacked


class MoE(nn.Module):
    """Replicated routing, tensor-parallel experts, or with ep > 1 expert-parallel ones whose
    tokens travel by all-to-all (`ep_dispatch`); the routed and shared partial outputs are added
    first so the layer needs one all-reduce either way."""

    def __init__(self, cfg: GlmConfig, dtype: torch.dtype, tp: TPGroup, ep: int = 1):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        # Registered in checkpoint order (experts, router, shared experts): `checkpoint_tensors`
        # lists tensors in parameter order, and the embedded model draws its values in that order.
        self.experts = Experts(cfg, dtype, tp, ep)
        self.gate = Gate(cfg)
        self.shared_experts = None
        if cfg.n_shared_experts:
            width = cfg.moe_intermediate_size * cfg.n_shared_experts
            self.shared_experts = MLP(cfg.hidden_size, width, dtype, tp, reduce=False)

    # the router and the routed experts read the normed input as is; the shared expert's products
    # may take it quantized (`norm_for`)
    reads_dense = True

    def takes_fp8_rows(self, m: int) -> bool:
        if self.experts.shared_id is not None:  # one kernel reads x for both
            return self.experts.takes_fp8_rows(m)
        return self.shared_experts is not None and self.shared_experts.takes_fp8_rows(m)

    def fuse_projections_(self) -> int:
        """The shared expert into the routed experts' kernel where it fits (`Experts.absorb_`)."""
        if self.shared_experts is None:
            return 0
        return int(self.experts.shared_id is not None or self.experts.absorb_(self.shared_experts))

    def forward(self, x, x_in: torch.Tensor | Fp8Rows | None = None, keep_parts: bool = False):
        """x: the normed hidden state; `x_in` its quantized rows for the shared expert and the
        routed experts' w8a8 kernel (`norm_for`). `keep_parts`: where nothing is added to the
        experts' sum after them (one rank, the shared expert in their stacks or none), it may come
        back not taken yet (`row_parts`), for the next norm to add."""
        cfg = self.cfg
        e = self.experts
        g = self.gate
        # block-FP8 experts on one expert group route the scores in their own launch (with the plan)
        weights = router_logits(x, g.weight, g.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                                cfg.norm_topk_prob, cfg.routed_scaling_factor, e.shared_id) \
            if e.fp8 and e.placement.ep == 1 else None
        ids = None
        if weights is None:
            weights, ids = route(x, g.weight, g.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                                 cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, shared=e.shared_id)
        if e.placement.ep > 1:
            out = ep_moe(x, weights, ids, e.placement, self.tp, e)
        else:  # the routed experts read the norm's quantized rows too, where they quantize x
            alone = self.tp.size == 1 and (self.shared_experts is None or e.shared_id is not None)
            out = e(x, weights, ids, x_rows=x_in if isinstance(x_in, Fp8Rows) else None,
                    keep_parts=keep_parts and alone)
        if self.shared_experts is not None and e.shared_id is None:
            out = out + self.shared_experts(x if x_in is None else x_in)
        return self.tp.all_reduce(out)

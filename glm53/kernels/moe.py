"""MoE routing (sigmoid scores, `e_score_correction_bias` for selection only, group-limited
selection, normalised top-k weights, routed scaling) and the expert/MLP forward.

`moe_experts` dispatches by `dispatch.use_triton`: the fused grouped-GEMM kernel
(`moe_triton.py`: expert-sorted pairs, gate+up with SiLU·mul in one kernel, down with the routing
weights, a deterministic sum over the k slots; no host sync) on CUDA tensors, the per-expert loop
`moe_experts_reference` on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.dispatch import use_triton
from glm53.kernels.linear_f32 import linear_f32


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
    shared: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [N, top_k] fp32, expert ids [N, top_k] int64). After the router GEMM, the
    Triton kernel (`route_triton.py`) where `use_triton` says so and selection is not grouped.
    `shared`: an expert id every token takes at weight 1 as slot top_k (the shared expert held in
    the routed experts' stack, `moe.MoE.fuse_projections_`): [N, top_k + 1] then."""
    scores = router_logits(x, gate_weight, correction_bias, top_k, n_group, norm_topk_prob, scaling, shared)
    if scores is not None:
        return scores.route()
    w, ids = route_reference(x, gate_weight, correction_bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
    if shared is None:
        return w, ids
    return torch.cat([w, w.new_ones(w.shape[0], 1)], 1), torch.cat([ids, ids.new_full((ids.shape[0], 1), shared)], 1)


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                  n_group: int, norm_topk_prob: bool, scaling: float, shared: int | None = None):
    """`route`'s Triton path stopped after the router GEMM: its scores and routing parameters as a
    `route_triton.RouterLogits`, for a launcher that routes them itself (the block-FP8 experts'
    tile kernels route and plan in one launch); None where `route` would not take that path."""
    if not (use_triton(x, gate_weight) and n_group <= 1):
        return None
    from glm53.kernels.route_triton import RouterLogits

    return RouterLogits(linear_f32(x, gate_weight), correction_bias.float(), top_k, norm_topk_prob, scaling, shared)


def route_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()
    choice = scores + correction_bias.float()
    n, e = choice.shape
    if n_group > 1:
        group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def swiglu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def moe_experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Routed experts: x [N, H]; weights [N, k]; ids [N, k]; gate/up [E, I, H]; down [E, H, I].
    Loops over the experts hit (reading the per-expert counts back to the host). The rows are
    gathered, weighted and added back once for all experts, in expert order (in fp32 the same sums
    as one add per expert in turn): per expert only its products run, which saves most of the
    per-op host cost that dominates at decode and verify sizes."""
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate.shape[0]).tolist()
    token_of = order // ids.shape[1]
    xs = x.index_select(0, token_of)
    ys, start = [], 0
    for e, c in enumerate(counts):
        if c:
            ys.append(swiglu_mlp(xs[start : start + c], gate[e], up[e], down[e]))
            start += c
    if not ys:  # no rows (an expert-parallel rank that received none)
        return out
    y = torch.cat(ys) if len(ys) > 1 else ys[0]
    return out.index_add_(0, token_of, y * weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype))


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Routed experts (shapes as `moe_experts_reference`), summed over each token's k experts
    with its routing weights; returns [N, H] in x's dtype."""
    if use_triton(x, weights, gate, up, down):
        from glm53.kernels.moe_triton import moe_experts_triton

        return moe_experts_triton(x, weights, ids, gate, up, down)
    return moe_experts_reference(x, weights, ids, gate, up, down)

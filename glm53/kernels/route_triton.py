"""MoE routing after the router GEMM as one Triton kernel: sigmoid, the correction bias for the
choice, top-k by repeated max, the chosen experts' sigmoid scores, normalisation and scaling.

In torch this is ~8 kernels per MoE layer (sigmoid, add, top-k, gather, sum, add, div, mul); a
program here routes one token with its E scores in registers. Ties pick the lowest expert id.
Group-limited selection (n_group > 1) stays on the torch path (`moe.route`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.moe_triton import PLAN_BLOCK_P, RoutingPlan, block_bound, store_segments, zero_blocks


@triton.jit
def route_row(logits_ptr, bias_ptr, row, E, stride_l, scaling, SHARED, K: tl.constexpr, K_PAD: tl.constexpr,
              BLOCK_E: tl.constexpr, NORM: tl.constexpr, K_OUT: tl.constexpr):
    """Token `row`'s routing: (weights [K_PAD] fp32, expert ids [K_PAD] int64), slots past K_OUT 0."""
    e = tl.arange(0, BLOCK_E)
    live = e < E
    s = tl.sigmoid(tl.load(logits_ptr + row * stride_l + e, mask=live, other=0.0).to(tl.float32))
    choice = tl.where(live, s + tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32), float("-inf"))
    slot = tl.arange(0, K_PAD)
    ws = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(choice, 0)
        pick = tl.min(tl.where(choice == best, e, BLOCK_E), 0)
        wj = tl.sum(tl.where(e == pick, s, 0.0), 0)
        ws = tl.where(slot == j, wj, ws)
        ids = tl.where(slot == j, pick.to(tl.int64), ids)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    ws = ws * scaling
    if K_OUT > K:  # the shared expert's slot: always on, weight 1
        ws = tl.where(slot == K, 1.0, ws)
        ids = tl.where(slot == K, SHARED, ids)
    return ws, ids


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_l, scaling, SHARED,
                  K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                  K_OUT: tl.constexpr, PDL: tl.constexpr = False):
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    row = tl.program_id(0).to(tl.int64)
    ws, ids = route_row(logits_ptr, bias_ptr, row, E, stride_l, scaling, SHARED, K, K_PAD, BLOCK_E, NORM, K_OUT)
    slot = tl.arange(0, K_PAD)
    keep = slot < K_OUT
    tl.store(w_ptr + row * K_OUT + slot, ws, mask=keep)
    tl.store(ids_ptr + row * K_OUT + slot, ids, mask=keep)


# The token count only bounds the routing loop: not specialized (kernels/variants.py)
@triton.jit(do_not_specialize=["N", "NZ"])
def _route_plan_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, order_ptr, seg_ptr, cum_ptr, z_ptr, N, E_R, NZ,
                       stride_l, scaling, SHARED, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                       NORM: tl.constexpr, K_OUT: tl.constexpr, N_PAD: tl.constexpr, E: tl.constexpr,
                       BLOCK_EP: tl.constexpr, BM: tl.constexpr, BLOCK_Z: tl.constexpr, PDL: tl.constexpr = False):
    """Program e: every token's routing (`route_row`, as `_route_kernel` computes it: the same
    bits), kept in registers (program 0 also stores it), then expert e's part of the routing plan
    from those ids as `moe_triton._plan_kernel` builds it from memory, and every E-th block of
    the NZ int32s at z zeroed. Each program routes all N tokens again: a decode batch's few."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    e = tl.program_id(0)
    zero_blocks(z_ptr, NZ, e, E, BLOCK_Z)
    rows = tl.arange(0, N_PAD)
    slot = tl.arange(0, K_PAD)
    wt = tl.zeros((N_PAD, K_PAD), dtype=tl.float32)
    it = tl.zeros((N_PAD, K_PAD), dtype=tl.int64)
    for r in range(0, N):
        ws, ids = route_row(logits_ptr, bias_ptr, r, E_R, stride_l, scaling, SHARED, K, K_PAD, BLOCK_E,
                            NORM, K_OUT)
        mine = rows[:, None] == r
        wt = tl.where(mine, ws[None, :], wt)
        it = tl.where(mine, ids[None, :], it)
    valid = (rows[:, None] < N) & (slot[None, :] < K_OUT)
    pair = rows[:, None] * K_OUT + slot[None, :]
    if e == 0:
        tl.store(w_ptr + pair, wt, mask=valid)
        tl.store(ids_ptr + pair, it, mask=valid)
    # the plan: bin E holds padding and strays (an id outside [0, E) joins no segment)
    v = tl.reshape(tl.where(valid & (it >= 0) & (it < E), it, E).to(tl.int32), (N_PAD * K_PAD,))
    p = tl.reshape(pair, (N_PAD * K_PAD,))
    below = tl.sum((v < e).to(tl.int32), 0)
    store_segments(tl.histogram(v, BLOCK_EP), below, e, seg_ptr, cum_ptr, E, BLOCK_EP, BM)
    hit = v == e
    rank = tl.cumsum(hit.to(tl.int32), 0)
    tl.store(order_ptr + below + rank - 1, p, mask=hit)


def route_triton(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
                 scaling: float, shared: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] (the router GEMM's output, fp32), bias [E] -> (weights [N, k] fp32, ids [N, k]
    int64); with `shared`, one more slot k holding that expert id at weight 1 ([N, k + 1])."""
    N, E = logits.shape
    assert correction_bias.shape == (E,) and logits.stride(1) == 1 and 0 < top_k <= E
    k_out = top_k + (shared is not None)
    w = torch.empty((N, k_out), dtype=torch.float32, device=logits.device)
    ids = torch.empty((N, k_out), dtype=torch.int64, device=logits.device)
    if N:
        _route_kernel[(N,)](logits, correction_bias, w, ids, E, logits.stride(0), float(scaling),
                            -1 if shared is None else shared, K=top_k, K_PAD=triton.next_power_of_2(k_out),
                            BLOCK_E=triton.next_power_of_2(E), NORM=norm_topk_prob, K_OUT=k_out,
                            num_warps=1 if E <= 256 else 4, **early_args())
    return w, ids


@dataclass(frozen=True)
class RouterLogits:
    """A router's scores not routed yet (`route_triton`'s inputs), for the block-FP8 experts'
    launcher: where its tile kernels run, one launch routes the tokens and plans their pairs
    (`route_plan_triton`); elsewhere `route()` routes them first."""

    logits: torch.Tensor  # [N, E_R] fp32
    bias: torch.Tensor  # [E_R] fp32
    top_k: int
    norm: bool
    scaling: float
    shared: int | None  # the shared expert's id in the kernel's stacks (slot top_k, weight 1), or None

    @property
    def k_out(self) -> int:
        return self.top_k + (self.shared is not None)

    def route(self) -> tuple[torch.Tensor, torch.Tensor]:
        return route_triton(self.logits, self.bias, self.top_k, self.norm, self.scaling, self.shared)

    def route_and_plan(self, n_experts: int, BM: int, zeros: torch.Tensor | None = None):
        return route_plan_triton(self.logits, self.bias, self.top_k, self.norm, self.scaling, self.shared,
                                 n_experts, BM, zeros)


# Tokens the routing and its plan share one launch up to (`route_plan_takes`): each of the plan's
# programs routes every token again, one after another, so the budget is tokens x router experts;
# the token tile is fixed (one compiled variant whatever the batch). Measured in the FP8 slice's
# graphed decode step on an H100 (2026-12-06): at 64 tokens the three launches took 333 µs a step
# (2,522 µs against 2,182 with the two launches each); at one token the one launch saves ~7 µs
# (1,030 against 1,037). Up to 4 tokens.
ROUTE_PLAN_MAX_TOKENS = 4
ROUTE_PLAN_MAX_WORK = 4096  # tokens x router experts


def route_plan_takes(n_tokens: int, n_router_experts: int) -> bool:
    """Whether `route_plan_triton` routes and plans n_tokens in one launch (the limits read at call time)."""
    return 0 < n_tokens <= ROUTE_PLAN_MAX_TOKENS and n_tokens * n_router_experts <= ROUTE_PLAN_MAX_WORK


def route_plan_triton(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
                      scaling: float, shared: int | None, n_experts: int, BM: int,
                      zeros: torch.Tensor | None = None):
    """`route_triton`'s (weights, ids) and `moe_triton.plan_routing(ids, n_experts, BM, zeros)`'s
    plan from one launch: (weights, ids, plan), the same values as the two launches give."""
    N, E_R = logits.shape
    assert correction_bias.shape == (E_R,) and logits.stride(1) == 1 and 0 < top_k <= E_R
    assert route_plan_takes(N, E_R), (N, E_R)
    assert zeros is None or (zeros.dtype == torch.int32 and zeros.is_contiguous()), zeros
    k_out = top_k + (shared is not None)
    dev = logits.device
    w = torch.empty((N, k_out), dtype=torch.float32, device=dev)
    ids = torch.empty((N, k_out), dtype=torch.int64, device=dev)
    order = torch.empty(N * k_out, dtype=torch.int32, device=dev)
    seg = torch.empty(n_experts + 1, dtype=torch.int32, device=dev)
    cum = torch.empty(n_experts, dtype=torch.int32, device=dev)
    _route_plan_kernel[(n_experts,)](
        logits, correction_bias, w, ids, order, seg, cum, seg if zeros is None else zeros, N, E_R,
        0 if zeros is None else zeros.numel(), logits.stride(0), float(scaling), -1 if shared is None else shared,
        K=top_k, K_PAD=triton.next_power_of_2(k_out), BLOCK_E=triton.next_power_of_2(E_R), NORM=norm_topk_prob,
        K_OUT=k_out, N_PAD=ROUTE_PLAN_MAX_TOKENS, E=n_experts, BLOCK_EP=triton.next_power_of_2(n_experts + 1), BM=BM,
        BLOCK_Z=PLAN_BLOCK_P, num_warps=1 if E_R <= 256 else 4, **early_args(),
    )
    return w, ids, RoutingPlan(order, seg, cum, block_bound(N * k_out, n_experts, BM), n_experts, BM)

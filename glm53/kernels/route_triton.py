"""MoE routing after the router GEMM as one Triton kernel: sigmoid, the correction bias for the
choice, top-k by repeated max, the chosen experts' sigmoid scores, normalisation and scaling.

In torch this is ~8 kernels per MoE layer (sigmoid, add, top-k, gather, sum, add, div, mul); a
program here routes one token with its E scores in registers. Ties pick the lowest expert id.
Group-limited selection (n_group > 1) stays on the torch path (`moe.route`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.launch_early import early_args, wait_then_release


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_l, scaling, SHARED,
                  K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                  K_OUT: tl.constexpr, PDL: tl.constexpr = False):
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    row = tl.program_id(0).to(tl.int64)
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
    keep = slot < K_OUT
    tl.store(w_ptr + row * K_OUT + slot, ws, mask=keep)
    tl.store(ids_ptr + row * K_OUT + slot, ids, mask=keep)


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

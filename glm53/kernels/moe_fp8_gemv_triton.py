"""Block-FP8 routed experts for a few tokens as GEMVs: each (token, slot) pair multiplies its own
expert's rows on the CUDA cores (the w8a16 mode of `moe_fp8_triton`: x and h stay in x's dtype,
no activation rounding).

At decode a token's k experts are distinct, so the tile kernels' routing plan (pairs sorted by
expert, 16-row blocks for the tensor cores) buys nothing: every weight row is read by one pair.
Here the grid is pairs × row blocks, with no plan and no sort:

- gate+up: program (p, nb, s) reads BN rows of gate and of up of expert ids[p] against x[p // k]
  over the s-th slice of H, accumulates element-wise in fp32 and sums once; unsplit it writes
  h[p, nb·BN : (nb+1)·BN] = silu(g)·u, split the slice's fp32 partials of g and u;
- down: program (p, hb) reads BN rows of down against h[p] (split: the partials summed in slice
  order, then silu(g)·u rounded to x's dtype, as unsplit) and writes y[p] times the routing
  weight;
- `moe_triton.sum_slots` adds each token's k rows in slot order (deterministic), as the tile path.

Split-K matters at one or two tokens: GLM-5's tp = 8 experts are 256 rows over H = 6144, so an
unsplit gate+up program walks 48 K steps of a few KB each, one after another.

Each 128-wide K block's codes are scaled by their block's scale as they are widened. Layouts as
`moe_fp8_triton`: gate/up [E, I, H] (or one fused gate_up [E, 2I, H], up row n at fused row I + n
with scale row (I + n) // 128), down [E, H, I]; ids in [0, E) (not checked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import sm_count, triton_interpreting
from glm53.kernels.fp8_quant import GROUP
from glm53.kernels.fp8_split_k import k_splits
from glm53.kernels.moe_triton import slot_parts, sum_slots
from glm53.kernels.row_parts import RowParts

SB = GROUP
# Past a few tokens pairs share experts (the stacked shared expert: every token's), which the
# tile kernels read once and the GEMVs once a pair. GLM-5's tp = 8 layer on the H200, shared expert
# stacked (9 slots; `benchmarks/moe_fp8_layer.py`): 27.0 / 45.3 / 79.4 µs at N = 1 / 2 / 4 against
# w8a8's 37.6 / 53.4 / 77.3.
MOE_GEMV_MAX_TOKENS = 2
# Experts at most this wide on a rank. Narrow experts leave the tile kernels bound by latency, not
# bytes: GLM-5's tp = 8 routed experts (I 256, H 6144, top-8) took 21.3 / 37.4 / 68.2 µs as GEMVs
# at N = 1 / 2 / 4 against w8a8's 36.5 / 52.9 / 76.2 (H200, 2026-12-04). Wide ones bound the GEMVs
# by the e4m3 widening on the CUDA cores: the slice's (I 2048) took 110–134 µs at N = 1 against 99.3.
MOE_GEMV_MAX_INTER = 256


def gemv_takes(n_tokens: int, inter: int) -> bool:
    """Whether w8a16 over n_tokens on experts `inter` wide runs as the per-pair GEMVs (the limits
    read at call time)."""
    return n_tokens <= MOE_GEMV_MAX_TOKENS and 0 < inter <= MOE_GEMV_MAX_INTER


@dataclass(frozen=True)
class MoEGemvConfig:
    """BN1 rows of gate (and of up) per gate+up program, H cut into at most SPLIT slices of whole
    scale blocks, BN2 rows of down per down program, K steps of BK (divides 128)."""

    BN1: int = 32
    BN2: int = 64
    BK: int = 128
    num_warps: int = 4
    num_stages: int = 3
    SPLIT: int = 1


def moe_gemv_config(pairs: int, inter: int, hidden: int, sms: int) -> MoEGemvConfig:
    """32-row gate+up blocks (two [32, 128] fp32 accumulators: 64 registers a thread at 4 warps),
    H halved into slices while the grid stays within five programs an SM and a slice keeps 4 scale
    blocks; 128 down rows a program. On the H200 at GLM-5's tp = 8 experts (I 256, H 6144) the
    sweep's best were 8 / 4 / 2 slices at N = 1 / 2 / 4 (64 / 128 / 256 row blocks: ~512
    programs), 128 down rows at N >= 2 (at 1, within 4 % of 64)."""
    if triton_interpreting():
        return MoEGemvConfig(BN1=16, BN2=32, num_warps=1, num_stages=1)
    blocks = pairs * triton.cdiv(inter, 32)
    split = 1
    while 2 * split * 4 * SB <= hidden and 2 * split * blocks <= 5 * sms:
        split *= 2
    return MoEGemvConfig(BN1=32, BN2=128, SPLIT=split)


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr,
    H, I, k, up_row0, k_per_split,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm, stride_hs,
    SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    sk = tl.program_id(2)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = nb * BN + tl.arange(0, BN)
    n_in = (n % I).to(tl.int64)  # rows past I re-read real ones (in bounds) and are not stored
    rk = tl.arange(0, BK)
    k_lo = sk * k_per_split
    k_hi = tl.minimum(H, k_lo + k_per_split)
    x_ptrs = x_ptr + (p // k).to(tl.int64) * stride_xm + k_lo + rk
    w_off = e * stride_we + n_in[:, None] * stride_wn + (k_lo + rk)[None, :]  # gate's and up's rows alike
    g_ptrs = wg_ptr + w_off
    u_ptrs = wu_ptr + w_off
    sg_rows = sg_ptr + e * stride_se + (n_in // SB) * stride_sn
    su_rows = su_ptr + e * stride_se + ((up_row0 + n_in) // SB) * stride_sn
    acc_g = tl.zeros((BN, BK), dtype=tl.float32)
    acc_u = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            x = tl.load(x_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            kin = (k0 + rk) < k_hi
            x = tl.load(x_ptrs, mask=kin, other=0.0)
            g = tl.load(g_ptrs, mask=kin[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=kin[None, :], other=0.0)
        x = x.to(tl.float32)[None, :]
        kb = k0 // SB
        acc_g += g.to(tl.float32) * tl.load(sg_rows + kb)[:, None] * x
        acc_u += u.to(tl.float32) * tl.load(su_rows + kb)[:, None] * x
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if SPLIT == 1:
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + p.to(tl.int64) * stride_hm + n, h.to(h_ptr.dtype.element_ty), mask=n < I)
    else:  # this slice's partials [split, pair, g | u]: the down kernel sums them
        row = h_ptr + sk.to(tl.int64) * stride_hs + p.to(tl.int64) * stride_hm + n
        tl.store(row, g, mask=n < I)
        tl.store(row + I, u, mask=n < I)


@triton.jit
def _down_gemv_kernel(
    h_ptr, ids_ptr, rw_ptr, wd_ptr, sd_ptr, y_ptr,
    H, I,
    stride_hm, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    SB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
):
    p = tl.program_id(0)
    hb = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = hb * BN + tl.arange(0, BN)
    n_in = (n % H).to(tl.int64)
    rk = tl.arange(0, BK)
    h_ptrs = h_ptr + p.to(tl.int64) * stride_hm + rk
    d_ptrs = wd_ptr + e * stride_we + n_in[:, None] * stride_wn + rk[None, :]
    s_rows = sd_ptr + e * stride_se + (n_in // SB) * stride_sn
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, I, BK):
        kin = (k0 + rk) < I
        if SPLIT == 1:
            if EVEN_K:
                h = tl.load(h_ptrs)
            else:
                h = tl.load(h_ptrs, mask=kin, other=0.0)
            h = h.to(tl.float32)
        else:  # the slices' g and u in slice order (deterministic), then h as the unsplit kernel rounds it
            g = tl.load(h_ptrs, mask=kin, other=0.0)
            u = tl.load(h_ptrs + I, mask=kin, other=0.0)
            for s in tl.static_range(1, SPLIT):
                g += tl.load(h_ptrs + s * stride_hs, mask=kin, other=0.0)
                u += tl.load(h_ptrs + s * stride_hs + I, mask=kin, other=0.0)
            h = (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty).to(tl.float32)
        if EVEN_K:
            d = tl.load(d_ptrs)
        else:
            d = tl.load(d_ptrs, mask=kin[None, :], other=0.0)
        acc += d.to(tl.float32) * tl.load(s_rows + k0 // SB)[:, None] * h[None, :]
        h_ptrs += BK
        d_ptrs += BK
    y = tl.sum(acc, axis=1) * tl.load(rw_ptr + p)
    tl.store(y_ptr + p.to(tl.int64) * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n < H)


def moe_experts_fp8_gemv(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor, up_scale: torch.Tensor, up_row0: int,
    down: torch.Tensor, down_scale: torch.Tensor, config: MoEGemvConfig | None = None, keep_parts: bool = False,
) -> torch.Tensor | RowParts:
    """x [N, H] contiguous rows; weights/ids [N, k]; gate/up [E, I, H] e4m3 views with their scale
    tensors (`up_row0`: the fused layout's I, whose up rows read scale rows (I + n) // 128; else 0);
    down [E, H, I] + scales. Shapes checked by the caller (`moe_fp8_triton.moe_experts_fp8_triton`).
    Returns [N, H] in x's dtype, or (`keep_parts`) the k slot rows not summed yet, for the norm
    after the layer to add (`row_parts`: one launch fewer a layer, as the tile kernels)."""
    N, H = x.shape
    k = ids.shape[1]
    I = gate.shape[1]
    M = N * k
    cfg = config or moe_gemv_config(M, I, H, sm_count(x.device))
    assert SB % cfg.BK == 0, cfg
    assert up.stride() == gate.stride() and up_scale.stride() == gate_scale.stride()
    split, k_per_split = k_splits(H, cfg.SPLIT)
    flat_ids = ids.reshape(-1).contiguous()
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    if split == 1:
        h = torch.empty((1, M, I), dtype=x.dtype, device=x.device)
    else:  # each slice's fp32 partials of g and u, side by side
        h = torch.empty((split, M, 2 * I), dtype=torch.float32, device=x.device)
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_gemv_kernel[(M, triton.cdiv(I, cfg.BN1), split)](
        x, flat_ids, gate, up, gate_scale, up_scale, h, H, I, k, up_row0, k_per_split,
        x.stride(0), gate.stride(0), gate.stride(1), gate_scale.stride(0), gate_scale.stride(1), h.stride(1),
        h.stride(0), SB=SB, BN=cfg.BN1, BK=cfg.BK, EVEN_K=H % cfg.BK == 0, SPLIT=split, **opts,
    )
    _down_gemv_kernel[(M, triton.cdiv(H, cfg.BN2))](
        h, flat_ids, rw, down, down_scale, y, H, I,
        h.stride(1), h.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        y.stride(0), SB=SB, BN=cfg.BN2, BK=cfg.BK, EVEN_K=I % cfg.BK == 0, SPLIT=split, **opts,
    )
    return slot_parts(y, N, k) if keep_parts else sum_slots(y, N, k)  # in a fixed order: deterministic

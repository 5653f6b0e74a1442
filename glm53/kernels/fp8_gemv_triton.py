"""Triton block-FP8 GEMV for a few rows: y = x @ dequant(W)^T, W [N, K] e4m3 with fp32 scales per
128×128 block, x [M, K] (M <= GEMV_MAX_M) kept in its dtype.

At decode a linear reads its weight and little else, so the product should run at the weight's
read rate. The tile GEMM (`fp8_gemm_triton`) pads M to 16 rows for the tensor cores and widens a
[BK, BN] weight tile for them; here each program owns BN weight rows and a slice of K, reads each
row's 128-byte scale block contiguously, widens the codes to fp32, scales them by their block's
scale and multiplies on the CUDA cores, every one of the M rows against the same registers (the
weight is read once for all M); the products accumulate element-wise in fp32 and are summed over
K once, after the last step (no reduction across threads per step). No activation rounding.

SPLIT_K > 1 cuts K at scale-block boundaries over a second grid axis (decode shapes have few
column blocks for 132 SMs), and the splits' fp32 partials are summed in a fixed order in one more
launch (`fp8_split_k.sum_splits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import sm_count, triton_interpreting
from glm53.kernels.fp8_split_k import fp8_rows, k_splits, sum_splits
from glm53.kernels.fp8_quant import GROUP

SB = GROUP  # scale block edge
GEMV_MAX_M = 8  # rows one program multiplies against its weight registers


@dataclass(frozen=True)
class GemvConfig:
    """BM rows (a power of two >= M), BN weight rows per program, K steps of BK (divides 128),
    SPLIT_K slices of K (whole scale blocks each)."""

    BM: int
    BN: int = 64
    BK: int = 128
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3


def gemv_config(M: int, N: int, K: int, device: torch.device | None = None) -> GemvConfig:
    """BM by M's power-of-two class; BN halves with every doubling of BM past 2 (the [BM, BN, BK]
    accumulator stays at 8-16K fp32 values: 64-128 registers a thread at 4 warps); K split so that
    ~4 programs run per SM. Guesses until `benchmarks/fp8_gemm.py`'s decode section has run on the
    H200."""
    assert 1 <= M <= GEMV_MAX_M, M
    bm = triton.next_power_of_2(M)
    bn = 64 if bm <= 2 else 128 // bm
    bk = 128
    if triton_interpreting():
        return GemvConfig(BM=bm, BN=bn, BK=bk, SPLIT_K=2, num_warps=1, num_stages=1)
    kb = triton.cdiv(K, SB)
    sms = sm_count(device or torch.device("cuda")) or 1
    tiles = triton.cdiv(N, bn)
    split = 1 if tiles >= 4 * sms else max(1, min(kb, 32, triton.cdiv(4 * sms, tiles)))
    return GemvConfig(BM=bm, BN=bn, BK=bk, SPLIT_K=split)


# M and the split stride vary with the batch: not specialized, so the config alone picks the
# compiled variant (kernels/variants.py).
@triton.jit(do_not_specialize=["M", "stride_ysplit"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_wsn, stride_ym, stride_ysplit,
    SB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
):
    pn = tl.program_id(0)
    sk = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    # rows past N and M are read modulo (in bounds) and never stored, so only K needs a mask
    rn_in = (rn % N).to(tl.int64)
    rm_in = (rm % M).to(tl.int64)
    k_lo = sk * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + (k_lo + rk)[None, :]
    ws_rows = ws_ptr + (rn_in // SB) * stride_wsn
    # Products accumulate element-wise over the K steps and are summed over K once at the end: a
    # reduction across threads every step would cost more than the step's arithmetic.
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            kin = (k0 + rk) < K
            w = tl.load(w_ptrs, mask=kin[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=kin[None, :], other=0.0)
        ws = tl.load(ws_rows + k0 // SB)
        w = w.to(tl.float32) * ws[:, None]  # e4m3 -> fp32 (exact), times its block's scale
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
        w_ptrs += BK
        x_ptrs += BK
    acc = tl.sum(acc, axis=2)  # [BM, BN]
    y_ptrs = y_ptr + sk.to(tl.int64) * stride_ysplit + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32, at most GEMV_MAX_M rows, kept as is), w [N, K] e4m3, w_scale
    [ceil(N/128), ceil(K/128)] fp32 -> [..., N] in out_dtype (default x's dtype)."""
    lead, x2, N, out_dtype = fp8_rows(x, w, w_scale, out_dtype)
    M, K = x2.shape
    if M == 0:
        return torch.empty((*lead, N), dtype=out_dtype, device=x.device)
    cfg = config or gemv_config(M, N, K, x.device)
    assert M <= cfg.BM and SB % cfg.BK == 0, (M, cfg)
    split, k_per_split = k_splits(K, cfg.SPLIT_K)
    y = torch.empty((split, M, N) if split > 1 else (M, N), dtype=torch.float32 if split > 1 else out_dtype,
                    device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(N, cfg.BN), split)](
        x2, w, w_scale, y, M, N, K, k_per_split,
        x2.stride(0), w.stride(0), w_scale.stride(0), y.stride(-2), y.stride(0) if split > 1 else 0,
        SB=SB, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EVEN_K=K % cfg.BK == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        y = sum_splits(y, out_dtype)
    return y.view(*lead, N)

"""Triton block-FP8 GEMV for decode's few rows: y = x @ dequant(W)^T, W [N, K] e4m3 with fp32
scales per 128×128 block, x [M, K] with M <= 8, in one launch.

Why a second kernel beside `fp8_gemm_triton`'s w8a16. At M = 1 a decode step's linears read
their weights and nothing else, and the tile kernel reached a third of HBM there (H200, the FP8
slice's decode step: 34 launches, 607 µs for ~0.97 GB): `tl.dot` wants 16 rows (15 of them
padding), and to fill 132 SMs from few 64-column tiles it splits K, which adds an fp32 partial
buffer, a sum and a cast (three launches a linear). Here a program owns BN output columns over
the whole of K, so the grid is N / BN programs with no split and no second pass: the result is
written once, in one fixed summation order (deterministic).

A program's loop: per K step of BK (whole 128-wide scale blocks), the [BN, BK] e4m3 tile is
widened to fp32 (exact) and multiplied with the step's x columns, each already times its block's
weight scale; the products are summed over K into an fp32 [MP, BN] accumulator (CUDA cores, no
MMA: one multiply-add per weight byte and row, so a few rows at most). BN divides 128, so a tile
lies in one scale row block: the step's scales are BK / 128 scalars of that row. Columns past N
are read modulo N (in bounds, never stored); rows past M and columns past K are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.fp8_quant import FP8, GROUP

SB = GROUP  # scale block edge
GEMV_MAX_ROWS = 8  # the accumulator is [MP, BN] fp32 per program; more rows belong to MMA tiles


@dataclass(frozen=True)
class GemvConfig:
    """BN output columns a program (divides 128), BK the K step (a multiple of 128)."""

    BN: int = 16
    BK: int = 512
    num_warps: int = 4


def default_gemv_config(M: int, N: int) -> GemvConfig:
    """The K step shrinks as rows grow, so the [MP, BN, BK] product stays ~8K elements a program
    (64 fp32 registers a thread at 4 warps). Narrow weights (N < 1024) take 8 columns a program, so
    a 576-row kv_a or a 128-row indexer key projection still spreads over 72 / 16 SMs."""
    mp = triton.next_power_of_2(max(1, M))
    return GemvConfig(BN=8 if N < 1024 else 16, BK=max(SB, 512 // mp), num_warps=4)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_wsn, stride_ym,
    MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr, EVEN_K: tl.constexpr,
):
    pn = tl.program_id(0)
    rn = pn * BN + tl.arange(0, BN)
    rn_in = (rn % N).to(tl.int64)
    rm = tl.arange(0, MP)
    m_in = rm < M
    rk = tl.arange(0, BK)
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    ws_row = ws_ptr + (pn * BN // SB).to(tl.int64) * stride_wsn  # the tile's scale row block
    acc = tl.zeros((MP, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_in[:, None], other=0.0)
            s = tl.load(ws_row + kk // SB)
        else:
            kin = kk < K
            w = tl.load(w_ptrs, mask=kin[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_in[:, None] & kin[None, :], other=0.0)
            s = tl.load(ws_row + kk // SB, mask=kin, other=0.0)
        xs = x.to(tl.float32) * s[None, :]
        acc += tl.sum(w.to(tl.float32)[None, :, :] * xs[:, None, :], axis=2)
        w_ptrs += BK
        x_ptrs += BK
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_in[:, None] & (rn < N)[None, :])


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32, at most GEMV_MAX_ROWS rows), w [N, K] e4m3, w_scale
    [ceil(N/128), ceil(K/128)] fp32 -> [..., N] in out_dtype (default x's dtype)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N, Kw = w.shape
    assert Kw == K, f"x has K={K}, the weight {tuple(w.shape)}"
    assert w.dtype == FP8 and w.stride(1) == 1, (w.dtype, w.stride())
    assert w_scale.shape == (triton.cdiv(N, SB), triton.cdiv(K, SB)) and w_scale.dtype == torch.float32, \
        (tuple(w_scale.shape), w_scale.dtype, "scales must be fp32 [ceil(N/128), ceil(K/128)]")
    assert w_scale.stride(1) == 1, w_scale.stride()
    assert M <= GEMV_MAX_ROWS, f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, got {M}"
    out_dtype = out_dtype or x.dtype
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y.view(*lead, N)
    cfg = config or default_gemv_config(M, N)
    assert SB % cfg.BN == 0 and cfg.BK % SB == 0, cfg
    _fp8_gemv_kernel[(triton.cdiv(N, cfg.BN),)](
        x2, w, w_scale, y, M, N, K,
        x2.stride(0), w.stride(0), w_scale.stride(0), y.stride(0),
        MP=triton.next_power_of_2(M), BN=cfg.BN, BK=cfg.BK, SB=SB, EVEN_K=K % cfg.BK == 0,
        num_warps=cfg.num_warps,
    )
    return y.view(*lead, N)

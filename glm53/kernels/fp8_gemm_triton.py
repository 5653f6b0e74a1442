"""Triton block-FP8 GEMM: y = x @ dequant(W)^T with W [N, K] e4m3 and fp32 scales per 128×128 block.

One kernel, two operand modes (a constexpr), so the two decode candidates differ in nothing else:

- w8a8 (`fp8_gemm_w8a8`, prefill): x is quantized per 1×128 group first (`fp8_quant`, one launch;
  or handed in already quantized), then an FP8 × FP8 product per K step; each 128-wide K block's
  partial product (fp32) is scaled by a_scale[m, kb] · w_scale[nb, kb] and added to an fp32
  accumulator (DeepSeek-V3's promotion: Hopper's FP8 MMA accumulates with reduced precision, so
  no partial sum spans more than one scale block);
  With LO the activation carries a second term (its residual's e4m3 codes and scales, `fp8_act`,
  decode sizes): the tile's rows are then virtual, a row's two terms side by side, so one product
  per K step multiplies the weight tile by both (each partial row scaled by its own activation
  scale) and the epilogue adds each pair;
- w8a16 (`fp8_gemm_w8a16`, dequantize in the kernel): x stays in its dtype (bf16), the e4m3
  weight tile is widened to it in registers (exact) and each block's partial product is scaled by
  w_scale[nb, kb]; no activation rounding, no extra launch.

Tiles: BM × BN outputs per program, K steps of BK (BK divides 128, so a step never straddles a
scale block); grouped program order (GROUP_M row tiles sweep a column stripe) for L2 reuse of the
weight tiles. Rows past M and columns past N are read modulo M / N (in bounds, never stored), so
only K needs a mask (when K is not a multiple of BK: partial last blocks). BN <= 128 puts a tile in
one scale row block (one scalar scale per K step); wider tiles load a scale per column.
SPLIT_K > 1 (decode: few output tiles for 132 SMs) cuts K at scale-block boundaries over a second
grid axis; the splits' fp32 partials [SPLIT_K, M, N] are summed in a fixed order (deterministic) and
cast in one more launch (`fp8_split_k.sum_splits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, sm_count, triton_interpreting
from glm53.kernels.fp8_act import two_terms
from glm53.kernels.fp8_quant import FP8, GROUP, quantize_fp8_terms_triton
from glm53.kernels.fp8_split_k import check_fp8_weight, k_splits, sum_splits
from glm53.kernels.launch_early import pdl_option, prefetch_rows_l2
from glm53.kernels.row_parts import RowParts

SB = GROUP  # scale block edge (weights 128×128, activations 1×128)


@dataclass(frozen=True)
class GemmConfig:
    """BM × BN output tile, BK the K step (divides 128), GROUP_M row tiles per column sweep,
    SPLIT_K slices of K (whole scale blocks each)."""

    BM: int
    BN: int
    BK: int = 128
    GROUP_M: int = 8
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3
    SWAP: bool = False
    # Programmatic dependent launch (CUDA): the programs start while the kernel that writes x
    # runs, put the first PREFETCH bytes of each of their weight rows into L2 (the weight does not
    # depend on it), then wait for it. 0: launched early, nothing prefetched
    PDL: bool = False
    PREFETCH: int = 0


def _split_k(tiles: int, k_blocks: int, device: torch.device, cap: int = 16) -> int:
    """Splits so that ~2 programs per SM run when the output has fewer tiles than SMs."""
    sms = sm_count(device)
    if not sms:
        return 1
    if tiles >= sms:
        return 1
    return max(1, min(k_blocks, cap, triton.cdiv(2 * sms, tiles)))


# One row tile, K of 16 blocks or more: 6 stages, even K splits, 8 warps where the unsplit tiles give
# two programs an SM (`default_config`). False: the rule before it, kept for the A/B in
# benchmarks/decode_tiles.py
DEEP_ONE_ROW = True


def _swap_split(tiles: int, k_blocks: int, device: torch.device, cap: int = 16, least: int = 4) -> int:
    """K splits of a one-row-tile decode product: the fewest that cut the scale blocks evenly, leave
    each split `least` blocks, and give about two programs an SM (5 % short counts); none such, the
    most that do the first two."""
    sms = sm_count(device)
    if not sms or tiles >= sms:
        return 1
    even = [s for s in range(1, min(cap, k_blocks // least) + 1) if k_blocks % s == 0]
    return next((s for s in even if 1.05 * s * tiles >= 2 * sms), even[-1] if even else 1)


def default_config(M: int, N: int, K: int, a_fp8: bool, device: torch.device | None = None,
                   lo: bool = False) -> GemmConfig:
    """Tiles by M: decode (M <= 64) -> short row tiles, 64 columns, split-K to fill the SMs (the
    weights are what is read; up to 32 virtual rows the weight tile is the product's left operand,
    SWAP); prefill -> 128×128 tiles (FP8 products compute-bound). `lo`: the
    activations carry two terms, so a tile's rows are 2M virtual ones (decode class all the same).
    Guesses until `benchmarks/fp8_gemm.py --sweep` has run on the H200."""
    decode = M <= 64
    M = 2 * M if lo else M
    if triton_interpreting():  # the interpreter's cost is per program and per K step
        return GemmConfig(BM=min(128, max(16, triton.next_power_of_2(M))), BN=128 if N > 64 else 64, BK=128,
                          GROUP_M=4, num_warps=1, num_stages=1)
    device = device or torch.device("cuda")
    kb = triton.cdiv(K, SB)
    if decode:
        bm = max(16, triton.next_power_of_2(M))
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, 64)
        # Split K only where each split still has a long walk: the splits' sum is one more launch,
        # which a short K (two blocks) never pays back, nor a w8a8 product under 32 blocks (H200,
        # GLM-5 tp = 8 shapes: K = 256 at M = 1 / 32 / 64 4.0 / 3.9 / 4.5 µs unsplit against 5.3 /
        # 6.1 / 7.7 split in two; at M = 64, K = 2048 and 1536 9.8-10.7 / 8.9-9.4 µs against 13.4
        # / 12.5 split in three)
        split = 1 if kb <= 2 or (a_fp8 and kb < 32) else _split_k(tiles, kb, device)
        if bm <= 32:  # one row tile: the weight tile is the MMA's long side (SWAP), the rows its
            # short one (H200, 2026-12-05, two terms: the slice's five products at M = 1 / 2 / 16
            # 120.0 / 117.6 / 124.5 µs swapped against 135.5 / 124.7 / 146.2, GLM-5's tp = 8 42.3 /
            # 41.7 / 44.2 against 46.2 / 46.3 / 52.2; 64 columns won or came within 3 %)
            # Launched early (PDL) with each row's first 256 bytes prefetched (H100, ten producer
            # -> product pairs at the slice's five shapes: 325.2 µs against 347.4 launched the usual
            # way, 332.0 early without a prefetch; 128 B as good, 512 B 326.3, 1024 B 337.5, the
            # whole split 449.9; the slice's decode step 10 µs shorter, 1,021 against 1,030 µs).
            # From 16 blocks on: 6 stages, even splits, 8 warps where the tiles alone give two
            # programs an SM (H200, 2026-12-06, M = 1, two terms, cold L2, the slice's seven
            # shapes, each product once a step: 293.6 µs summed at 4 stages, splits from 32 blocks
            # and 4 warps; 271.6 with these, each measured; 267.1 the best config of each. N x K:
            # 4096 x 2048 7.8 -> 6.4 µs split in 4; 6144 x 16384 29.2 -> 27.4 in 4 against 3;
            # 16384 x 2048 13.5 -> 12.4; 24576 x 6144 46.1 -> 40.8 at 8 warps, where 16384 x 2048
            # was faster at 4); a shorter K keeps the split above and 4 stages (not measured)
            stages, warps = 4, 4
            if kb >= 16 and DEEP_ONE_ROW:
                split, stages = _swap_split(tiles, kb, device), 6
                warps = 8 if split == 1 and tiles >= 2 * sm_count(device) else 4
            return GemmConfig(BM=bm, BN=64, BK=128, GROUP_M=8, SPLIT_K=split, num_warps=warps, num_stages=stages,
                              SWAP=True, PDL=True, PREFETCH=256)
        if bm > 64:  # two terms past 32 rows: 64-row tiles, 128 columns (H200, the slice's five
            # products at M = 64: 219 µs summed against 266 for one 128 x 64 tile, 256 for the best
            # 128-row tile; one term 172)
            tiles = triton.cdiv(M, 64) * triton.cdiv(N, 128)
            split = 1 if kb < 32 else _split_k(tiles, kb, device)
            return GemmConfig(BM=64, BN=128, BK=128, GROUP_M=8, SPLIT_K=split, num_warps=4, num_stages=4)
        return GemmConfig(BM=bm, BN=64, BK=128, GROUP_M=8, SPLIT_K=split, num_warps=4, num_stages=4)
    if a_fp8 and kb <= 3:  # a short K (the shared expert's down, K = 256 at tp = 8): a program is
        # mostly its epilogue, so smaller tiles and two stages keep more programs per SM (H200,
        # M = 4096, N = 6144, K = 256: 44.0 µs against 51.2 for the 128×128 tile below)
        return GemmConfig(BM=64, BN=128, BK=128, GROUP_M=8, num_warps=4, num_stages=2)
    if a_fp8:  # 32 KB a stage
        return GemmConfig(BM=128, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=4)
    return GemmConfig(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3)  # 24 KB a stage


@triton.jit
def swapped_product(a, w, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """a [BM, BK] times the weight tile: w [BK, BN] -> [BM, BN]; with SWAP w is [BN, BK], the
    product's left operand (the MMA's long side at decode), -> [BN, BM]."""
    if SWAP:
        return tl.dot(w, tl.trans(a), input_precision=PRECISION)
    else:
        return tl.dot(a, w, input_precision=PRECISION)


@triton.jit
def along_rows(v, SWAP: tl.constexpr):
    """A vector over the activation rows, shaped to scale `swapped_product`'s accumulator."""
    if SWAP:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def along_cols(v, SWAP: tl.constexpr):
    """A vector over the output columns, shaped to scale `swapped_product`'s accumulator."""
    if SWAP:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def weight_tile(base, n, stride_n, k, SWAP: tl.constexpr):
    """A weight tile's addresses: base + column n * stride_n + k, laid [BN, BK] with SWAP
    (`swapped_product`'s left operand), else [BK, BN]."""
    if SWAP:
        return base + n[:, None] * stride_n + k[None, :]
    else:
        return base + n[None, :] * stride_n + k[:, None]


@triton.jit
def accumulator(BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """Zeros shaped as `swapped_product`'s result: [BN, BM] with SWAP, else [BM, BN]."""
    if SWAP:
        return tl.zeros((BN, BM), dtype=tl.float32)
    else:
        return tl.zeros((BM, BN), dtype=tl.float32)


@triton.jit
def rows_first(acc, SWAP: tl.constexpr):
    """An accumulator as [BM, BN] (rows first), whichever its layout."""
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


# M (the tokens) and the split stride (M·N) vary with every batch: not specialized, so the tile
# config (`default_config`, a few M classes) alone picks the compiled variant (kernels/variants.py).
@triton.jit(do_not_specialize=["M", "stride_ysplit"])
def _block_fp8_gemm_kernel(
    a_ptr, as_ptr, al_ptr, als_ptr, w_ptr, ws_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_ym, stride_ysplit,
    A_FP8: tl.constexpr, LO: tl.constexpr, SB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    sk = tl.program_id(1)
    # LO: the tile's rows are virtual, two per output row (its first term, then its second), so one
    # product per K step multiplies the weight tile by both terms (a decode tile's rows are mostly
    # padding anyway); each virtual row's partial takes its own activation scale, and the epilogue
    # adds each pair of rows
    ROWS: tl.constexpr = 2 if LO else 1
    num_m = tl.cdiv(M * ROWS, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    local = pid % width
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + local % rows_here
    pn = local // rows_here
    rv = pm * BM + tl.arange(0, BM)  # virtual rows
    rn = pn * BN + tl.arange(0, BN)
    rm_in = (rv // ROWS % M).to(tl.int64)
    rn_in = (rn % N).to(tl.int64)
    rk = tl.arange(0, BK)
    k_lo = sk * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PDL:
        if PREFETCH > 0:  # (GemmConfig.PDL)
            prefetch_rows_l2(w_ptr + rn_in * stride_wn + k_lo, tl.minimum(k_hi - k_lo, PREFETCH))
        tl.extra.cuda.gdc_wait()  # x, its scales and y are the previous kernel's
    a_off = rm_in[:, None] * stride_am + (k_lo + rk)[None, :]
    as_off = rm_in * stride_asm
    if LO:  # the second term has the first's layout
        first = rv % 2 == 0
        a_ptrs = tl.where(first[:, None], a_ptr + a_off, al_ptr + a_off)
        as_row = tl.where(first, as_ptr + as_off, als_ptr + as_off)
    else:
        a_ptrs = a_ptr + a_off
        as_row = as_ptr + as_off
    # with SWAP the weight tile is the product's left operand [BN, BK] (the MMA's long side)
    w_ptrs = weight_tile(w_ptr, rn_in, stride_wn, k_lo + rk, SWAP)
    acc = accumulator(BM, BN, SWAP)
    if BN <= SB:  # the tile lies in one scale row block: one scalar per K step
        ws_row = ws_ptr + (pn * BN // SB).to(tl.int64) * stride_wsn
    else:
        ws_row = ws_ptr + (rn_in // SB) * stride_wsn
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            kin = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=kin[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kin[None, :] if SWAP else kin[:, None], other=0.0)
        if DOT_F32:  # the interpreter: widen both (exact) and multiply in fp32
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        elif not A_FP8:  # dequantize in the kernel: e4m3 -> x's dtype (exact)
            w = w.to(a_ptr.dtype.element_ty)
        part = swapped_product(a, w, SWAP, PRECISION)
        kb = k0 // SB
        ws = tl.load(ws_row + kb)
        if A_FP8:
            xs = along_rows(tl.load(as_row + kb * stride_ask), SWAP)
            if BN <= SB:
                acc += part * (xs * ws)
            else:
                acc += part * xs * along_cols(ws, SWAP)
        else:
            if BN <= SB:
                acc += part * ws
            else:
                acc += part * along_cols(ws, SWAP)
        a_ptrs += BK
        w_ptrs += BK
    acc = rows_first(acc, SWAP)
    if LO:
        acc = tl.sum(tl.reshape(acc, (BM // 2, 2, BN)), axis=1)
    rm = pm * (BM // ROWS) + tl.arange(0, BM // ROWS)
    y_ptrs = y_ptr + sk.to(tl.int64) * stride_ysplit + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def _launch(a, a_scale, w, w_scale, M, N, K, out_dtype, cfg: GemmConfig, a_fp8: bool,
            lo: tuple[torch.Tensor, torch.Tensor] | None = None, keep_parts: bool = False) -> torch.Tensor | RowParts:
    assert SB % cfg.BK == 0 and cfg.BN & (cfg.BN - 1) == 0, cfg
    if lo is not None:
        assert lo[0].shape == a.shape and lo[0].stride() == a.stride() and lo[0].dtype == a.dtype, "lo codes: a's layout"
        assert lo[1].shape == a_scale.shape and lo[1].stride() == a_scale.stride(), "lo scales: a_scale's layout"
    split, k_per_split = k_splits(K, cfg.SPLIT_K)
    if split == 1:
        y = torch.empty((M, N), dtype=out_dtype, device=a.device)
    else:
        y = torch.empty((split, M, N), dtype=torch.float32, device=a.device)
    interp = triton_interpreting()
    pdl = cfg.PDL and not interp  # griddepcontrol is inline PTX: compiled kernels only
    grid = (triton.cdiv(M * (2 if lo is not None else 1), cfg.BM) * triton.cdiv(N, cfg.BN), split)
    _block_fp8_gemm_kernel[grid](
        a, a_scale, *(lo or (a, a_scale)), w, w_scale, y, M, N, K, k_per_split,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0), w_scale.stride(0), y.stride(-2),
        y.stride(0) if split > 1 else 0,
        A_FP8=a_fp8, LO=lo is not None, SB=SB, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
        EVEN_K=K % cfg.BK == 0, DOT_F32=interp,
        PRECISION=dot_precision(torch.float32 if interp else a.dtype), SWAP=cfg.SWAP,
        PDL=pdl, PREFETCH=cfg.PREFETCH if pdl else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_option(pdl),
    )
    if split > 1:  # the splits' sum, or (keep_parts) the sum not taken yet, for a norm that adds it
        y = RowParts(y, out_dtype) if keep_parts else sum_splits(y, out_dtype)
    return y


def fp8_gemm_w8a16(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """Dequantize-in-kernel: x [..., K] (bf16/fp16/fp32, kept as is), w [N, K] e4m3, w_scale
    [ceil(N/128), ceil(K/128)] fp32 -> [..., N] in out_dtype (default x's dtype)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N = check_fp8_weight(w, w_scale, K)
    out_dtype = out_dtype or x.dtype
    if M == 0:
        return torch.empty((*lead, N), dtype=out_dtype, device=x.device)
    cfg = config or default_config(M, N, K, a_fp8=False, device=x.device)
    y = _launch(x2, w_scale, w, w_scale, M, N, K, out_dtype, cfg, a_fp8=False)  # a_scale unused
    return y.view(*lead, N)


def fp8_gemm_w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype | None = None, config: GemmConfig | None = None,
                  x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                  lo: bool | None = None) -> torch.Tensor:
    """Activations quantized per 1×128 group (`quantize_fp8_groups`; with the second term where
    `lo`, by default `fp8_act.two_terms(M)`), then the block-scaled FP8 GEMM. x [..., K] any float
    dtype; `x_fp8` = (q [M, K] e4m3, scale [M, ceil(K/128)] fp32) when the caller already holds x
    quantized (then x only gives the shape and default out dtype, and one term is read)."""
    lead, K = x.shape[:-1], x.shape[-1]
    if x_fp8 is None:
        x2 = x.reshape(-1, K)
        q, s, x_lo = quantize_fp8_terms_triton(x2, two_terms(x2.shape[0]) if lo is None else lo, SB)
    else:
        (q, s), x_lo = x_fp8, None
    assert q.shape[0] == x.numel() // K, (q.shape, x.shape)
    return fp8_gemm_w8a8_quantized(q, s, w, w_scale, out_dtype or x.dtype, config, lo=x_lo).view(*lead, w.shape[0])


def fp8_gemm_w8a8_quantized(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, config: GemmConfig | None = None,
                            lo: tuple[torch.Tensor, torch.Tensor] | None = None,
                            keep_parts: bool = False) -> torch.Tensor | RowParts:
    """The block-scaled FP8 GEMM on activations already quantized: q [M, K] e4m3 (unit column
    stride), s [M, ceil(K/128)] fp32 (any strides: `fp8_act.Fp8Rows` holds them column-major, or
    row-major with the second term) -> [M, N] in out_dtype. `lo`: the second term (q's and s's layouts), multiplied too."""
    M, K = q.shape
    N = check_fp8_weight(w, w_scale, K)
    assert q.dtype == FP8 and q.stride(1) == 1, (q.dtype, q.stride())
    assert s.shape == (M, triton.cdiv(K, SB)) and s.dtype == torch.float32, (s.shape, s.dtype)
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=q.device)
    cfg = config or default_config(M, N, K, a_fp8=True, device=q.device, lo=lo is not None)
    return _launch(q, s, w, w_scale, M, N, K, out_dtype, cfg, a_fp8=True, lo=lo, keep_parts=keep_parts)

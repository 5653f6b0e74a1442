"""Triton fused MoE over block-FP8 experts: the grouped GEMMs of `moe_triton.py` with e4m3 weights
and fp32 scales per 128×128 block, on the same routing plan (`plan_routing`, `block_tile`: the
pairs sorted by expert on the device, no host sync).

    out[t] = Σ_j w[t, j] · down[e] · (silu(gate[e] · x[t]) ⊙ (up[e] · x[t])),   e = ids[t, j]

with every weight dequantized blockwise (`fp8_quant.dequantize_fp8_blocks`). Two operand modes,
as `fp8_gemm_triton` (the choice at decode sizes is measured by benchmarks/fp8_gemm.py):

- "w8a16" (dequantize in the kernel): x and h = silu(g)·u stay in x's dtype; each e4m3 weight
  tile is widened to it in registers (exact) and each 128-wide K block's partial product is
  scaled by the weight's block scale before it joins the fp32 accumulator.
- "w8a8": x is quantized per 1×128 group once per token (`quantize_fp8_groups`, before the
  gather); the gate+up kernel quantizes h in its epilogue (its column tile is one 128-wide group,
  so BN1 = 128) and writes h as e4m3 plus [N·k, ceil(I/128)] scales; both GEMMs multiply FP8 by FP8
  and scale each K block's partial by a_scale[row, kb] · w_scale[nb, kb]. At decode sizes
  (`fp8_act.two_terms` of the token count) x and h carry a second e4m3 term (the residual's codes
  and scales, `fp8_quant`): a tile's rows are then virtual, each (token, expert) pair's two terms
  side by side (the plan's blocks hold BM / 2 pairs), so one product per K step reads both, each
  partial row scaled by its own activation scale, and each pair of rows is added after the K loop;
  the gate+up epilogue writes h's two terms.

Weight layouts: gate and up [E, I, H] with scales [E, ceil(I/128), ceil(H/128)] each (the model's
`Experts`), or one fused gate_up [E, 2I, H] (gate rows, then up rows) with scales
[E, ceil(2I/128), ceil(H/128)], passed as `gate` with `up=None`: up row n is fused row I + n and
reads scale row (I + n) // 128, so an I that is not a multiple of 128 (a scale block holding gate
and up rows) is handled too. down [E, H, I] with scales [E, ceil(H/128), ceil(I/128)].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, sm_count, triton_interpreting
from glm53.kernels.fp8_act import two_terms
from glm53.kernels.fp8_gemm_triton import accumulator, along_cols, along_rows, rows_first, swapped_product, weight_tile
from glm53.kernels.fp8_split_k import k_splits
from glm53.kernels.fp8_quant import FP8, GROUP, quantize_fp8_terms_triton, quantize_residual_tile, quantize_tile
from glm53.kernels.launch_early import pdl_option, prefetch_rows_l2
from glm53.kernels.moe_fp8_gemv_triton import MoEGemvConfig, gemv_takes, moe_experts_fp8_gemv
from glm53.kernels.moe_triton import MoEConfig, block_bound, block_tile, plan_routing, slot_parts, sum_slots
from glm53.kernels.route_triton import RouterLogits, route_plan_takes
from glm53.kernels.row_parts import RowParts

SB = GROUP
VARIANTS = ("w8a16", "w8a8")
# The gate+up kernel at decode sizes (H200, benchmarks/moe_fp8_layer.py and a sweep of the swapped
# tiles, 2026-12-05, GLM-5's tp = 8 stacks and the slice's, each with the shared expert as one
# more): with the weight tiles as the products' left operands (SWAP) K is split in SPLIT_MAX (a
# power of two) whenever the grid has fewer tiles than SMs (GLM-5, 1 / 2 / 4 tokens: 33.8 / 45.1 /
# 63.2 µs split in 4 against 48.9 / 48.1 / 65.6 unsplit or in 2; from 8 tokens, and on the slice's
# 16 column tiles an expert, the grid fills the SMs and no split wins), keeping at least
# SPLIT_MIN_BLOCKS scale blocks of K a split; 3 pipeline stages, 2 once an expert has 4 rows on
# average (the slice at 8 tokens: 185.1 µs against 194.1).
SPLIT_MAX = 4
SPLIT_MIN_BLOCKS = 4
# The grid splits while it has fewer tiles than SPLIT_WAVES times the SMs. The slice at one token
# (tp = 1: 144 tiles on the H200's 132 SMs) runs a second, nearly empty wave unsplit; split in 4
# at 2 waves, the step was longer (H100's 132 SMs, benchmarks/step_knobs.py, 2026-12-07: 943.8
# against 919.0 us at one token, 981.4 against 980.8 at four): 1.
SPLIT_WAVES = 1.0
# Decode tiles: the down kernel launched while gate+up runs (MoEConfig.PDL; on since timed with the
# other early launches, launch_early.SMALL_KERNELS; H100, 2026-12-06). Each program may first
# prefetch DOWN_PREFETCH bytes of each of its weight rows into L2; timed alone in the slice's step
# (benchmarks/step_knobs.py, H100, 2026-12-07) 256 bytes cost 0.4-0.6 % at 1, 4 and 16 tokens
# against none (919.0 vs 914.1 us at one token, four rounds) and nothing at 64: off.
DOWN_PDL = True
DOWN_PREFETCH = 0


def decode_split(n_pairs: int, n_experts: int, bm: int, bn1: int, inter: int, hidden: int, sms: int) -> int:
    """K splits of the gate+up kernel for n_pairs (token, expert) pairs: its grid's tile bound
    (`plan_routing`'s row blocks times the column tiles) against the SMs."""
    if not (inter and hidden and sms):
        return 1
    tiles = block_bound(n_pairs, n_experts, bm) * triton.cdiv(inter, bn1)
    if tiles >= SPLIT_WAVES * sms:
        return 1
    most = min(SPLIT_MAX, triton.cdiv(hidden, SB) // SPLIT_MIN_BLOCKS)
    return 1 << (most.bit_length() - 1) if most > 1 else 1


def default_fp8_config(n_pairs: int, n_experts: int, variant: str, inter: int = 0, hidden: int = 0,
                       sms: int = 0, lo: bool = False) -> MoEConfig:
    """Tiles by expected rows per expert, as `moe_triton.default_config`; K steps of one scale
    block (128; 64 for bf16 activations past decode); w8a8 fixes BN1 = 128 (the epilogue quantizes
    one 128-wide group of h per row). Each K step keeps a partial product beside each accumulator
    (scaled, then added), so the gate+up kernel holds four [BM, BN1] fp32 tiles: BM·BN1 / (32 ·
    warps) registers each, at most 32 here. At decode sizes the gate+up kernel splits K when its
    tiles leave SMs idle (`decode_split`: needs the experts' width `inter`, `hidden` and the
    GPU's `sms`; none given, no split), and both kernels take the weight tile as the products'
    left operand (SWAP: the MMA's long side; the pairs' few rows its short one). `lo` (w8a8 with
    two activation terms): a tile's BM rows are virtual, BM / 2 pairs' two terms each."""
    bn1 = 128 if variant == "w8a8" else None
    rows = n_pairs / max(1, n_experts)
    if triton_interpreting():  # the interpreter pays per program and per multiply-add of padding
        bm = min(64, max(16, triton.next_power_of_2(int(rows))))
        return MoEConfig(BM=bm, BN1=bn1 or 64, BN2=64, BK=128, GROUP_M=4, num_warps=1, num_stages=1)
    if rows <= 16:  # decode: 16-row blocks, the weight stream is the cost
        bn1 = bn1 or 64
        split = decode_split(n_pairs, n_experts, 8 if lo else 16, bn1, inter, hidden, sms)
        return MoEConfig(BM=16, BN1=bn1, BN2=64, BK=128, num_warps=4, num_stages=2 if rows >= 4 else 3, SPLIT_K=split,
                         SWAP=True, PDL=DOWN_PDL, PREFETCH=DOWN_PREFETCH)
    # 40 KB a stage (w8a8: an fp8 x tile and two fp8 weight tiles), 24 KB for bf16 x with K steps of 64
    return MoEConfig(BM=64, BN1=128, BN2=128, BK=128 if variant == "w8a8" else 64, num_warps=8, num_stages=3)


@triton.jit(do_not_specialize=["n_blocks"])  # follows the token count
def _gate_up_fp8_kernel(
    x_ptr, xs_ptr, xl_ptr, xls_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, hs_ptr, hl_ptr, hls_ptr,
    order_ptr, seg_ptr, cum_ptr, part_ptr, cnt_ptr,
    n_blocks, H, I, TOPK, UP_ROW0, k_per_split,
    stride_xn, stride_xsn, stride_xsk, stride_we, stride_wi, stride_se, stride_si, stride_hm, stride_hsm,
    E: tl.constexpr, BLOCK_E: tl.constexpr, SB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
    A_FP8: tl.constexpr, LO: tl.constexpr, SCALAR_S: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, EXACT_RNE: tl.constexpr, SWAP: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    if TRIGGER:  # the down kernel may launch now (MoEConfig.PDL)
        tl.extra.cuda.gdc_launch_dependents()
    # LO: x and h in two terms; the tile's BM rows are virtual, each of its BR (token, expert)
    # pairs' two terms side by side, so one product per K step reads both (a decode tile's rows
    # are mostly padding), and each pair of rows is added after the loop
    ROWS: tl.constexpr = 2 if LO else 1
    BR: tl.constexpr = BM // ROWS
    tile = tl.program_id(0)
    e, nt, pos, valid = block_tile(tile, n_blocks, (I + BN - 1) // BN, seg_ptr, cum_ptr,
                                   E, BLOCK_E, BR, GROUP_M)
    if e >= E:  # past the last block (the grid is an upper bound)
        return
    k_lo = tl.program_id(1) * k_per_split  # this split's K range (whole scale blocks)
    # rows past the expert's segment read pair 0's token (in bounds) and are never stored
    pair = tl.load(order_ptr + pos, mask=valid, other=0)
    tok = (pair // TOPK).to(tl.int64)
    n = nt * BN + tl.arange(0, BN)
    n_in = n % I  # columns past I re-read real rows (no mask); they are not stored
    k = tl.arange(0, BK)
    e64 = e.to(tl.int64)
    if LO:  # x's second term has x's layout
        tok = tl.reshape(tl.join(tok, tok), (BM,))
        first = tl.arange(0, BM) % 2 == 0
        a_off = tok[:, None] * stride_xn + k_lo + k[None, :]
        a_ptrs = tl.where(first[:, None], x_ptr + a_off, xl_ptr + a_off)
        xs_row = tl.where(first, xs_ptr + tok * stride_xsn, xls_ptr + tok * stride_xsn)
    else:
        a_ptrs = x_ptr + tok[:, None] * stride_xn + k_lo + k[None, :]
        xs_row = xs_ptr + tok * stride_xsn
    # with SWAP the weight tiles are [BN, BK], the products' left operand, and the accumulators [BN, BM]
    w_off = weight_tile(e64 * stride_we, n_in.to(tl.int64), stride_wi, k_lo + k, SWAP)
    g_ptrs = wg_ptr + w_off
    u_ptrs = wu_ptr + w_off
    if SCALAR_S:  # BN <= 128 and up's rows aligned to scale blocks: one scale per tile and K step
        sg_row = sg_ptr + e64 * stride_se + (nt * BN // SB) * stride_si
        su_row = su_ptr + e64 * stride_se + ((UP_ROW0 + nt * BN) // SB) * stride_si
    else:
        sg_row = sg_ptr + e64 * stride_se + (n_in // SB) * stride_si
        su_row = su_ptr + e64 * stride_se + ((UP_ROW0 + n_in) // SB) * stride_si
    acc_g = accumulator(BM, BN, SWAP)
    acc_u = accumulator(BM, BN, SWAP)
    for k0 in range(k_lo, tl.minimum(H, k_lo + k_per_split), BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            kin = (k0 + k) < H
            kw = kin[None, :] if SWAP else kin[:, None]
            a = tl.load(a_ptrs, mask=kin[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=kw, other=0.0)
            wu = tl.load(u_ptrs, mask=kw, other=0.0)
        if DOT_F32:  # the interpreter: widen (exact), multiply in fp32
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        elif not A_FP8:  # dequantize in the kernel: e4m3 -> x's dtype (exact)
            wg = wg.to(x_ptr.dtype.element_ty)
            wu = wu.to(x_ptr.dtype.element_ty)
        pg = swapped_product(a, wg, SWAP, PRECISION)
        pu = swapped_product(a, wu, SWAP, PRECISION)
        kb = k0 // SB
        if SCALAR_S:
            gs = tl.load(sg_row + kb)
            us = tl.load(su_row + kb)
        else:
            gs = along_cols(tl.load(sg_row + kb), SWAP)
            us = along_cols(tl.load(su_row + kb), SWAP)
        if A_FP8:
            xs = along_rows(tl.load(xs_row + kb * stride_xsk), SWAP)
            acc_g += pg * (xs * gs)
            acc_u += pu * (xs * us)
        else:
            acc_g += pg * gs
            acc_u += pu * us
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    acc_g = rows_first(acc_g, SWAP)
    acc_u = rows_first(acc_u, SWAP)
    if LO:
        acc_g = tl.sum(tl.reshape(acc_g, (BR, 2, BN)), axis=1)
        acc_u = tl.sum(tl.reshape(acc_u, (BR, 2, BN)), axis=1)
    if SPLIT_K > 1:
        # Each split leaves its partials in its slot of the tile's workspace and counts itself in;
        # the last to arrive sums the SPLIT_K slots in split order (deterministic whatever the
        # arrival order) and runs the epilogue. The barriers order every thread's stores before
        # the release and the acquire before every thread's loads; ".cg" reads around L1.
        r = tl.arange(0, BR)[:, None] * BN + tl.arange(0, BN)[None, :]
        tile_ws = part_ptr + tile.to(tl.int64) * (SPLIT_K * 2 * BR * BN)
        mine = tile_ws + tl.program_id(1) * (2 * BR * BN)
        tl.store(mine + r, acc_g)
        tl.store(mine + BR * BN + r, acc_u)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        tl.debug_barrier()
        acc_g = tl.zeros((BR, BN), dtype=tl.float32)
        acc_u = tl.zeros((BR, BN), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc_g += tl.load(tile_ws + s * (2 * BR * BN) + r, cache_modifier=".cg")
            acc_u += tl.load(tile_ws + s * (2 * BR * BN) + BR * BN + r, cache_modifier=".cg")
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    keep = valid[:, None] & (n < I)[None, :]
    h_ptrs = h_ptr + pos[:, None].to(tl.int64) * stride_hm + n[None, :]
    if A_FP8:  # quantize h: this tile (BN = 128) is group nt of each of its rows
        h = tl.where((n < I)[None, :], h, 0.0)
        codes, scale = quantize_tile(h, EXACT_RNE)
        tl.store(h_ptrs, codes, mask=keep)
        tl.store(hs_ptr + pos.to(tl.int64) * stride_hsm + nt, scale, mask=valid)
        if LO:  # and its second term
            codes, scale = quantize_residual_tile(h, codes, scale, EXACT_RNE)
            tl.store(hl_ptr + pos[:, None].to(tl.int64) * stride_hm + n[None, :], codes, mask=keep)
            tl.store(hls_ptr + pos.to(tl.int64) * stride_hsm + nt, scale, mask=valid)
    else:
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["n_blocks"])
def _down_fp8_kernel(
    h_ptr, hs_ptr, hl_ptr, hls_ptr, wd_ptr, sd_ptr, y_ptr, rw_ptr, order_ptr, seg_ptr, cum_ptr,
    n_blocks, H, I,
    stride_hm, stride_hsm, stride_we, stride_wh, stride_se, stride_sh, stride_ym,
    E: tl.constexpr, BLOCK_E: tl.constexpr, SB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    A_FP8: tl.constexpr, LO: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    # LO: h in two terms, read as the gate+up kernel reads x (virtual rows, pairs added after)
    ROWS: tl.constexpr = 2 if LO else 1
    BR: tl.constexpr = BM // ROWS
    e, nt, pos, valid = block_tile(tl.program_id(0), n_blocks, (H + BN - 1) // BN, seg_ptr, cum_ptr,
                                   E, BLOCK_E, BR, GROUP_M)
    if e >= E:  # past the last block (the grid is an upper bound)
        return
    n = nt * BN + tl.arange(0, BN)
    n_in = n % H
    k = tl.arange(0, BK)
    e64 = e.to(tl.int64)
    pos64 = pos.to(tl.int64)
    if PDL:  # launched while gate+up runs: the plan above is older than it, the weight is no one's
        if PREFETCH > 0:
            prefetch_rows_l2(wd_ptr + e64 * stride_we + n_in.to(tl.int64) * stride_wh, tl.minimum(I, PREFETCH))
        tl.extra.cuda.gdc_wait()  # h and its scales are gate+up's
    # a last block's rows past the segment (and past N·k) are masked: never read, never stored
    if LO:  # h's second term has h's layout
        pv = tl.reshape(tl.join(pos64, pos64), (BM,))
        vi = valid.to(tl.int32)
        rows_in = tl.reshape(tl.join(vi, vi), (BM,)) != 0
        first = tl.arange(0, BM) % 2 == 0
        a_off = pv[:, None] * stride_hm + k[None, :]
        a_ptrs = tl.where(first[:, None], h_ptr + a_off, hl_ptr + a_off)
        hs_row = tl.where(first, hs_ptr + pv * stride_hsm, hls_ptr + pv * stride_hsm)
    else:
        rows_in = valid
        a_ptrs = h_ptr + pos64[:, None] * stride_hm + k[None, :]
        hs_row = hs_ptr + pos64 * stride_hsm
    # with SWAP the weight tile [BN, BK] is the product's left operand; acc [BN, BM]
    w_ptrs = weight_tile(wd_ptr + e64 * stride_we, n_in.to(tl.int64), stride_wh, k, SWAP)
    acc = accumulator(BM, BN, SWAP)
    if BN <= SB:
        sd_row = sd_ptr + e64 * stride_se + (nt * BN // SB) * stride_sh
    else:
        sd_row = sd_ptr + e64 * stride_se + (n_in // SB) * stride_sh
    for k0 in range(0, I, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows_in[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            kin = (k0 + k) < I
            a = tl.load(a_ptrs, mask=rows_in[:, None] & kin[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kin[None, :] if SWAP else kin[:, None], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        elif not A_FP8:
            w = w.to(h_ptr.dtype.element_ty)
        part = swapped_product(a, w, SWAP, PRECISION)
        kb = k0 // SB
        if BN <= SB:
            ws = tl.load(sd_row + kb)
        else:
            ws = along_cols(tl.load(sd_row + kb), SWAP)
        if A_FP8:
            acc += part * (along_rows(tl.load(hs_row + kb, mask=rows_in, other=0.0), SWAP) * ws)
        else:
            acc += part * ws
        a_ptrs += BK
        w_ptrs += BK
    acc = rows_first(acc, SWAP)
    if LO:
        acc = tl.sum(tl.reshape(acc, (BR, 2, BN)), axis=1)
    pair = tl.load(order_ptr + pos, mask=valid, other=0)
    rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
    y = acc * rw[:, None]
    y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (n < H)[None, :])


def _check_expert(w: torch.Tensor, s: torch.Tensor, name: str) -> None:
    E, R, C = w.shape
    assert w.dtype == FP8 and w.stride(2) == 1 and w.stride(1) == C, f"{name}: e4m3, contiguous per expert"
    assert s.shape == (E, triton.cdiv(R, SB), triton.cdiv(C, SB)) and s.dtype == torch.float32, \
        f"{name} scales: fp32 [E, ceil({R}/128), ceil({C}/128)], got {s.dtype} {tuple(s.shape)}"
    assert s.stride(2) == 1, f"{name} scales: unit stride on the K blocks"


def moe_experts_fp8_triton(
    x: torch.Tensor,
    weights: torch.Tensor | RouterLogits,
    ids: torch.Tensor | None,
    gate: torch.Tensor,
    gate_scale: torch.Tensor,
    up: torch.Tensor | None,
    up_scale: torch.Tensor | None,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    variant: str = "w8a16",
    config: MoEConfig | MoEGemvConfig | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_lo: tuple[torch.Tensor, torch.Tensor] | None = None,
    lo: bool | None = None,
    keep_parts: bool = False,
) -> torch.Tensor | RowParts:
    """x [N, H] (bf16/fp16/fp32); weights [N, k] fp32; ids [N, k] in [0, E) (not checked: that
    would need a host sync); experts in the module docstring's layouts; variant "w8a16" or
    "w8a8" (w8a16 where `gemv_takes` says so, or with a `MoEGemvConfig`: the per-pair
    GEMVs of `moe_fp8_gemv_triton`). Returns [N, H] in x's dtype. `x_fp8` = x already quantized per 1×128 group (q [N, H]
    e4m3, scales [N, ceil(H/128)] fp32, any strides: `fp8_act.Fp8Rows.rows()`), read by w8a8;
    `x_lo` its second term (`Fp8Rows.lo_rows()`), if any. `lo` (default `two_terms(N)`): w8a8
    carries the second term of h, and of x where this function quantizes it. `weights` may be the
    router's scores not routed yet (`RouterLogits`, `ids` None): the tile kernels' plan launch
    routes them (`route_plan_takes`), else they are routed first."""
    assert variant in VARIANTS, variant
    N, H = x.shape
    router = weights if isinstance(weights, RouterLogits) else None
    k = router.k_out if router is not None else ids.shape[1]
    _check_expert(gate, gate_scale, "gate")
    E = gate.shape[0]
    if up is None:  # fused [E, 2I, H]
        assert up_scale is None and gate.shape[1] % 2 == 0
        I = gate.shape[1] // 2
        up, up_scale, up_row0 = gate[:, I:], gate_scale, I
        gate = gate[:, :I]
    else:
        _check_expert(up, up_scale, "up")
        I, up_row0 = gate.shape[1], 0
        assert up.shape == gate.shape and up.stride() == gate.stride() and up_scale.stride() == gate_scale.stride()
    _check_expert(down, down_scale, "down")
    assert gate.shape[2] == H and down.shape == (E, H, I), (x.shape, gate.shape, down.shape)
    if router is not None and (N == 0 or not route_plan_takes(N, router.logits.shape[1])):
        weights, ids = router.route()
        router = None
    assert router is not None or weights.shape == ids.shape == (N, k)
    if N == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    if variant == "w8a16" and (isinstance(config, MoEGemvConfig) or (config is None and gemv_takes(N, down.shape[2]))):
        if router is not None:
            weights, ids = router.route()
        return moe_experts_fp8_gemv(x, weights, ids, gate, gate_scale, up, up_scale, up_row0, down, down_scale, config,
                                    keep_parts)
    M = N * k
    a_fp8 = variant == "w8a8"
    lo = a_fp8 and (two_terms(N) if lo is None else lo)
    rows = 2 if lo else 1  # a tile's rows per (token, expert) pair
    cfg = config or default_fp8_config(M, E, variant, I, H, sm_count(x.device), lo=lo)
    assert SB % cfg.BK == 0, f"BK must divide {SB}: {cfg}"
    assert not a_fp8 or cfg.BN1 == SB, f"w8a8 quantizes h in 128-wide column tiles: BN1 must be {SB}"
    # split K: each tile's partials, and how many of its splits are in (the last sums them); the
    # plan's launch zeroes the counts
    split, k_per_split = k_splits(H, cfg.SPLIT_K)
    tiles = block_bound(M, E, cfg.BM // rows) * triton.cdiv(I, cfg.BN1)
    count = torch.empty(tiles, dtype=torch.int32, device=x.device) if split > 1 else None
    if router is not None:  # routed and planned in one launch
        weights, ids, plan = router.route_and_plan(E, cfg.BM // rows, zeros=count)
    else:
        plan = plan_routing(ids, E, cfg.BM // rows, zeros=count)
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    interp = triton_interpreting()
    pdl = cfg.PDL and not interp  # griddepcontrol is inline PTX: compiled kernels only
    if a_fp8:
        if x_fp8 is None:
            xa, xs, x_lo = quantize_fp8_terms_triton(x, lo, SB)
        else:
            xa, xs = x_fp8
        assert xa.shape == x.shape and xa.stride(1) == 1 and xs.shape == (N, triton.cdiv(H, SB)), (xa.shape, xs.shape)
        assert (x_lo is not None) == lo, f"x quantized in {2 if x_lo is not None else 1} terms, the rule gives {rows}"
        if lo:
            assert x_lo[0].stride() == xa.stride() and x_lo[1].stride() == xs.stride(), "x_lo: x_fp8's layout"
        h = torch.empty((M, I), dtype=FP8, device=x.device)
        hs = torch.empty((M, triton.cdiv(I, SB)), dtype=torch.float32, device=x.device)
    else:
        xa, xs = x, x  # xs unused
        h = torch.empty((M, I), dtype=x.dtype, device=x.device)
        hs = h  # unused
        x_lo = None
    hl, hls = (torch.empty_like(h), torch.empty_like(hs)) if lo else (h, hs)  # unread without LO
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    common = dict(E=E, BLOCK_E=plan.block_e, SB=SB, BM=cfg.BM, BK=cfg.BK, GROUP_M=cfg.GROUP_M, A_FP8=a_fp8, SWAP=cfg.SWAP,
                  DOT_F32=interp, PRECISION=dot_precision(torch.float32 if interp else x.dtype),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert tiles == plan.n_blocks * triton.cdiv(I, cfg.BN1)
    if split > 1:
        part = torch.empty((tiles, split, 2, cfg.BM // rows, cfg.BN1), dtype=torch.float32, device=x.device)
    else:
        part = count = rw  # unused
    _gate_up_fp8_kernel[(tiles, split)](
        xa, xs, *(x_lo or (xa, xs)), gate, up, gate_scale, up_scale, h, hs, hl, hls, plan.order, plan.seg, plan.cum, part, count,
        plan.n_blocks, H, I, k, up_row0, k_per_split,
        xa.stride(0), xs.stride(0), xs.stride(1), gate.stride(0), gate.stride(1), gate_scale.stride(0), gate_scale.stride(1),
        h.stride(0), hs.stride(0),
        BN=cfg.BN1, SPLIT_K=split, LO=lo, SCALAR_S=cfg.BN1 <= SB and up_row0 % SB == 0, EVEN_K=H % cfg.BK == 0,
        EXACT_RNE=interp, TRIGGER=pdl, **common,
    )
    _down_fp8_kernel[(plan.n_blocks * triton.cdiv(H, cfg.BN2),)](
        h, hs, hl, hls, down, down_scale, y, rw, plan.order, plan.seg, plan.cum,
        plan.n_blocks, H, I,
        h.stride(0), hs.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        y.stride(0),
        BN=cfg.BN2, LO=lo, EVEN_K=I % cfg.BK == 0, PDL=pdl, PREFETCH=cfg.PREFETCH if pdl else 0, **common,
        **pdl_option(pdl),
    )
    # in a fixed order: deterministic; or (keep_parts) not taken yet, for the norm that adds it
    return slot_parts(y, N, k) if keep_parts else sum_slots(y, N, k)

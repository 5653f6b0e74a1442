"""The block-FP8 MoE's gate+up at decode sizes as a stream-K grid: every program streams the same
number of weight bytes.

`moe_fp8_triton`'s gate+up kernel gives each (row block, 128-wide column tile) pair one program
that walks all of K. At one token the FP8 slice's layer has 9 experts × 16 tiles = 144 programs of
1.57 MB on 132 SMs: 12 SMs hold two, and on a card whose copy rate needs more than an SM's share
of bytes in flight (an H200 at 4.3 TB/s: ~32 GB/s an SM) those 12 stream last. Here the grid is a
fixed number of programs, `programs_per_sm` an SM, and the work — every real tile's K blocks, in
tile order — is cut into that many equal runs. A run streams its K blocks in one pipelined loop
whatever tile they belong to (the tile's addresses are a scalar offset added to one offset tensor),
and at each tile's last block (or the run's last) it stores its partial sums to its slot of the
workspace. After the loop, for each tile it touched, it counts itself in (an acq_rel atomic); the
last of the tile's runs to arrive sums the tile's partials in run order (deterministic whatever the
arrival order) and runs the gate+up epilogue (`gate_up_epilogue`, the tile kernel's).

The number of real tiles is read on the device (the plan's cumulative block count), so the grid
suits CUDA graphs. A run spans at most three tiles when the tiles are at most twice the programs
(`stream_takes`); the counters are the ones the plan's launch zeroes (`plan_routing(zeros=)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.fp8_gemm_triton import along_rows, rows_first, swapped_product, weight_tile
from glm53.kernels.fp8_quant import quantize_residual_tile, quantize_tile

# The most tiles a run may touch: runs of at least K-block-count - 1 blocks (tiles <= 2x programs)
SPAN = 3


@triton.jit
def gate_up_epilogue(acc_g, acc_u, n, pos, valid, nt, I, h_ptr, hs_ptr, hl_ptr, hls_ptr, stride_hm, stride_hsm,
                     A_FP8: tl.constexpr, LO: tl.constexpr, EXACT_RNE: tl.constexpr):
    """h = silu(g) · u for one tile (acc_g, acc_u [BR, BN]: rows first, a pair's two terms added),
    stored at the sorted positions `pos` (where `valid`): in x's dtype, or (A_FP8) quantized as
    128-wide group `nt` of each row, with its second term under LO."""
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


@triton.jit
def _run_of(unit, P, U):
    """The run (program) holding K block `unit` of U cut into P runs [p·U // P, (p+1)·U // P)."""
    return ((unit + 1) * P - 1) // U


@triton.jit
def _tile_rows(t, NT, seg_ptr, cum_ptr, order_ptr, TOPK, E: tl.constexpr, BLOCK_E: tl.constexpr,
               BR: tl.constexpr):
    """Tile t (row block t // NT, column tile t % NT; blocks in the plan's expert order) -> its
    expert, column tile, sorted pair positions, which are inside the expert's segment, and their
    tokens (rows past the segment read pair 0's token, in bounds, never stored)."""
    b = t // NT
    ev = tl.arange(0, BLOCK_E)
    cum = tl.load(cum_ptr + ev, mask=ev < E, other=2147483647)
    e = tl.minimum(tl.sum((cum <= b).to(tl.int32), 0), E - 1)
    seg_lo = tl.load(seg_ptr + e)
    seg_hi = tl.load(seg_ptr + e + 1)
    first = tl.load(cum_ptr + e) - (seg_hi - seg_lo + BR - 1) // BR
    pos = seg_lo + (b - first) * BR + tl.arange(0, BR)
    valid = pos < seg_hi
    pair = tl.load(order_ptr + pos, mask=valid, other=0)
    return e, t % NT, pos, valid, (pair // TOPK).to(tl.int64)


@triton.jit
def _rows_of(tok, x_ptr, xl_ptr, xs_ptr, xls_ptr, stride_xn, stride_xsn, k, LO: tl.constexpr):
    """A tile's activation row addresses [BM, BK] at K block 0 and scale rows [BM] (LO: each
    pair's two terms side by side, as the tile kernel reads them)."""
    if LO:
        tok2 = tl.reshape(tl.join(tok, tok), (tok.shape[0] * 2,))
        first = tl.arange(0, tok.shape[0] * 2) % 2 == 0
        a_off = tok2[:, None] * stride_xn + k[None, :]
        return (tl.where(first[:, None], x_ptr + a_off, xl_ptr + a_off),
                tl.where(first, xs_ptr + tok2 * stride_xsn, xls_ptr + tok2 * stride_xsn))
    else:
        return x_ptr + tok[:, None] * stride_xn + k[None, :], xs_ptr + tok * stride_xsn


@triton.jit
def _pick(j, v0, v1, v2):
    return tl.where(j == 0, v0, tl.where(j == 1, v1, v2))


@triton.jit(do_not_specialize=["P"])
def _gate_up_stream_kernel(
    x_ptr, xs_ptr, xl_ptr, xls_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, hs_ptr, hl_ptr, hls_ptr,
    order_ptr, seg_ptr, cum_ptr, ws_ptr, cnt_ptr,
    P, I, TOPK, UP_ROW0,
    stride_xn, stride_xsn, stride_xsk, stride_we, stride_wi, stride_se, stride_si, stride_hm, stride_hsm,
    E: tl.constexpr, BLOCK_E: tl.constexpr, SB: tl.constexpr, KB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
    A_FP8: tl.constexpr, LO: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    EXACT_RNE: tl.constexpr, TRIGGER: tl.constexpr,
):
    if TRIGGER:  # the down kernel may launch now (MoEConfig.PDL)
        tl.extra.cuda.gdc_launch_dependents()
    ROWS: tl.constexpr = 2 if LO else 1
    BR: tl.constexpr = BM // ROWS
    NT = I // BN
    p = tl.program_id(0)
    U = tl.load(cum_ptr + E - 1) * NT * KB  # the real tiles' K blocks
    U64 = U.to(tl.int64)
    u0 = (p * U64 // P).to(tl.int32)
    u1 = ((p + 1) * U64 // P).to(tl.int32)
    if u0 >= u1:
        return
    t0 = u0 // KB
    # the (up to SPAN) tiles this run touches: expert, column tile, rows, and their scalar offsets
    e_0, nt_0, pos_0, ok_0, tok_0 = _tile_rows(t0, NT, seg_ptr, cum_ptr, order_ptr, TOPK, E, BLOCK_E, BR)
    e_1, nt_1, pos_1, ok_1, tok_1 = _tile_rows(t0 + 1, NT, seg_ptr, cum_ptr, order_ptr, TOPK, E, BLOCK_E, BR)
    e_2, nt_2, pos_2, ok_2, tok_2 = _tile_rows(t0 + 2, NT, seg_ptr, cum_ptr, order_ptr, TOPK, E, BLOCK_E, BR)
    k = tl.arange(0, BK)
    rn = tl.arange(0, BN)
    w_off = weight_tile(0, rn.to(tl.int64), stride_wi, k, True)  # [BN, BK]: one tile's rows at K block 0
    a_0, xs_0 = _rows_of(tok_0, x_ptr, xl_ptr, xs_ptr, xls_ptr, stride_xn, stride_xsn, k, LO)
    a_1, xs_1 = _rows_of(tok_1, x_ptr, xl_ptr, xs_ptr, xls_ptr, stride_xn, stride_xsn, k, LO)
    a_2, xs_2 = _rows_of(tok_2, x_ptr, xl_ptr, xs_ptr, xls_ptr, stride_xn, stride_xsn, k, LO)
    wb_0 = e_0.to(tl.int64) * stride_we + (nt_0 * BN).to(tl.int64) * stride_wi
    wb_1 = e_1.to(tl.int64) * stride_we + (nt_1 * BN).to(tl.int64) * stride_wi
    wb_2 = e_2.to(tl.int64) * stride_we + (nt_2 * BN).to(tl.int64) * stride_wi
    sb_0 = e_0.to(tl.int64) * stride_se + (nt_0 * BN // SB) * stride_si
    sb_1 = e_1.to(tl.int64) * stride_se + (nt_1 * BN // SB) * stride_si
    sb_2 = e_2.to(tl.int64) * stride_se + (nt_2 * BN // SB) * stride_si
    sbu = (UP_ROW0 // SB) * stride_si  # up's scale rows (UP_ROW0 a multiple of SB)
    # this run's partials: SPAN slots of two [BN, BM] tiles, stored in the accumulators' layout
    slot = rn[:, None] * BM + tl.arange(0, BM)[None, :]
    mine = ws_ptr + p.to(tl.int64) * (SPAN * 2 * BN * BM)
    acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    for u in range(u0, u1):
        j = u // KB - t0
        kb = u % KB
        a = tl.load(_pick(j, a_0, a_1, a_2) + kb * BK)
        w_at = w_off + (_pick(j, wb_0, wb_1, wb_2) + kb * BK)
        wg = tl.load(wg_ptr + w_at)
        wu = tl.load(wu_ptr + w_at)
        if DOT_F32:  # the interpreter: widen (exact), multiply in fp32
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        elif not A_FP8:  # dequantize in the kernel: e4m3 -> x's dtype (exact)
            wg = wg.to(x_ptr.dtype.element_ty)
            wu = wu.to(x_ptr.dtype.element_ty)
        pg = swapped_product(a, wg, True, PRECISION)
        pu = swapped_product(a, wu, True, PRECISION)
        s_at = _pick(j, sb_0, sb_1, sb_2) + kb
        gs = tl.load(sg_ptr + s_at)
        us = tl.load(su_ptr + sbu + s_at)
        if A_FP8:
            xs = along_rows(tl.load(_pick(j, xs_0, xs_1, xs_2) + kb * stride_xsk), True)
            acc_g += pg * (xs * gs)
            acc_u += pu * (xs * us)
        else:
            acc_g += pg * gs
            acc_u += pu * us
        # a tile's last block, or the run's: its partials to slot j, the accumulators restart
        flush = (kb == KB - 1) | (u == u1 - 1)
        at = mine + j * (2 * BN * BM)
        fm = slot < tl.where(flush, BN * BM, 0)
        tl.store(at + slot, acc_g, mask=fm)
        tl.store(at + BN * BM + slot, acc_u, mask=fm)
        acc_g = tl.where(flush, 0.0, acc_g)
        acc_u = tl.where(flush, 0.0, acc_u)
    tl.debug_barrier()  # every thread's partial stores before the counts' release
    t_last = (u1 - 1) // KB
    for jj in tl.static_range(SPAN):
        t = t0 + jj
        if t <= t_last:
            r_lo = _run_of(t * KB, P, U)
            r_hi = _run_of(t * KB + KB - 1, P, U)
            if tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel") == r_hi - r_lo:
                tl.debug_barrier()  # the acquire before every thread's loads
                g = tl.zeros((BN, BM), dtype=tl.float32)
                up = tl.zeros((BN, BM), dtype=tl.float32)
                for r in range(r_lo, r_hi + 1):  # in run order: deterministic
                    rt0 = ((r * U64 // P) // KB).to(tl.int32)  # run r's first tile
                    src = ws_ptr + r * (SPAN * 2 * BN * BM) + (t - rt0) * (2 * BN * BM)
                    g += tl.load(src + slot, cache_modifier=".cg")
                    up += tl.load(src + BN * BM + slot, cache_modifier=".cg")
                g = rows_first(g, True)
                up = rows_first(up, True)
                if LO:
                    g = tl.sum(tl.reshape(g, (BR, 2, BN)), axis=1)
                    up = tl.sum(tl.reshape(up, (BR, 2, BN)), axis=1)
                nt = _pick(jj, nt_0, nt_1, nt_2)
                pos = _pick(jj, pos_0, pos_1, pos_2)
                valid = _pick(jj, ok_0, ok_1, ok_2)
                gate_up_epilogue(g, up, nt * BN + rn, pos, valid, nt, I, h_ptr, hs_ptr, hl_ptr, hls_ptr, stride_hm,
                                 stride_hsm, A_FP8, LO, EXACT_RNE)


def stream_takes(tiles_bound: int, programs: int, H: int, I: int, BN: int, BK: int, SB: int, up_row0: int) -> bool:
    """The stream-K grid's preconditions: whole column tiles and K blocks (no masks in its loop),
    one scale block a tile and K step, up's scale rows aligned, and runs spanning at most SPAN
    tiles (runs of at least KB - 1 blocks where the tile bound is at most twice the programs)."""
    return (I % BN == 0 and H % BK == 0 and BK == SB and SB % BN == 0 and up_row0 % SB == 0
            and tiles_bound <= 2 * programs)


def gate_up_stream(xa, xs, x_lo, gate, up, gate_scale, up_scale, h, hs, hl, hls, plan, count: torch.Tensor,
                   programs: int, topk: int, up_row0: int, cfg, lo: bool, a_fp8: bool, pdl: bool, interp: bool,
                   precision: str) -> None:
    """Launch the stream-K gate+up over `plan` (`moe_fp8_triton.moe_experts_fp8_triton`'s operands;
    `count` the tiles' counters, zeroed by the plan's launch) in `programs` programs."""
    H, I, SB = xa.shape[1], gate.shape[1], cfg.BK
    ws = torch.empty((programs, SPAN, 2, cfg.BN1, cfg.BM), dtype=torch.float32, device=xa.device)
    _gate_up_stream_kernel[(programs,)](
        xa, xs, *x_lo, gate, up, gate_scale, up_scale, h, hs, hl, hls, plan.order, plan.seg, plan.cum, ws, count,
        programs, I, topk, up_row0,
        xa.stride(0), xs.stride(0), xs.stride(1), gate.stride(0), gate.stride(1), gate_scale.stride(0),
        gate_scale.stride(1), h.stride(0), hs.stride(0),
        E=gate.shape[0], BLOCK_E=plan.block_e, SB=SB, KB=H // cfg.BK, BM=cfg.BM, BN=cfg.BN1, BK=cfg.BK, SPAN=SPAN,
        A_FP8=a_fp8, LO=lo, DOT_F32=interp, PRECISION=precision, EXACT_RNE=interp, TRIGGER=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

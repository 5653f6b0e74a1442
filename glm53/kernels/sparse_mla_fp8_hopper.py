"""Sparse MLA decode/verify over the FP8 latent cache for Hopper (sm_90), in Gluon.

The bf16 Hopper kernel (`sparse_mla_hopper`) with another producer: the two consumer warpgroups
(`_ws_scores`, `_ws_values_hi`) are imported unchanged and run wgmma on bf16 tiles in shared
memory; `_ws_dequant` fills those tiles from the 656 B FP8 rows (`latent_cache_fp8`: 512 e4m3,
4 fp32 tile scales, 64 bf16 rope values). Why dequantize in the producer and not fold the scales
into the products as `sparse_mla_fp8_triton` does: the consumers stay the measured bf16 ones, and
the FP8 row gathers 57% of the bf16 row's bytes, so the gather (the bf16 kernel's limit) shrinks
while the tensor-core work is the same.

Per block of BN slots, the producer (4 warps):
- the rope part (bf16 in the cache) goes straight into its tile by cp.async, as in the bf16 kernel;
- the fp8 latent is loaded into registers before waiting for the tile to be free (so those loads
  are in flight while the consumers finish with it), then each 128-column tile is widened,
  multiplied by its power-of-two scale (exact) and stored as bf16. Not a block further ahead: a
  loop-carried fp8 tensor is held a byte a register (256 registers, spilled to local memory).
A tile is full after 128 cp.async arrivals (one per producer thread) plus one arrival after the
latent stores (so `c_full` counts 129). Invalid slots (-1) load nothing and give zero rows.

A second producer, `_ws_dequant_staged` (`stages` 2 or 3, 32-slot blocks): cp.async copies each
block's raw rows (fp8, scales, rope) into a staging ring 1-2 blocks ahead and widens them from
shared memory. Why: the first producer's rows in flight are bounded by its registers (one block,
32 KB) and it waits out each block's load latency; staging keeps two blocks in flight without
registers, at the cost of 32-slot tiles (64-slot tiles leave no shared memory for it). Which of
the two is faster is measured (benchmarks/fp8_mla.py); the default is the first.

`producers=2`: the first producer's 4 warps as two 2-warp partitions (`_ws_dequant_even` /
`_odd`), each filling one of the two buffers: every block still waits out its load latency, but
two blocks are loading at once and one partition's loads overlap the other's widening and stores
(at 27% of HBM the single partition is bound by that serial latency, not by bytes).

Heads: any count, in 64-row tiles (a masked tail: 8 heads, GLM-5's per-rank count at tp=8, run
one tile with 56 empty rows; the kernel is bound by the gathers, not by the products).
Shared memory is the bf16 kernel's (q, two BN-slot bf16 buffers, P): 64-slot blocks fill it.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from glm53.kernels.latent_cache_fp8 import LatentLayout, views
from glm53.kernels.sparse_mla_hopper import (
    BLOCK_H, MAXNREG, REGS_VALUES, _copy_layout, _copy_query, _load_slots, _program_buffers, _ws_scores, _ws_values_hi,
)
from glm53.kernels.sparse_mla_triton import LOG2E, Splits, finish_splits, launch_inputs, plan_splits

KV_LORA_RANK = 512  # the shapes the buffers are sized for (GLM-5): 512 fp8 + 4 scales + 64 bf16
ROPE_DIM = 64
TILE = gl.constexpr(128)  # latent columns per fp32 scale (latent_cache_fp8.TILE)
FP8_VEC = gl.constexpr(16)  # 16-byte loads of fp8
# The producer holds a block's fp8 rows (64 regs a thread at 64 slots), its scales and addresses:
# 104 spilled least in an offline sm_90 build (WG1 168, the default warpgroup the rest, 232).
REGS_DEQUANT = gl.constexpr(104)
REGS_STAGED = gl.constexpr(96)  # the staged producer holds no rows in flight
# Two producer partitions of 2 warps taking alternate blocks (`producers=2`): the same 4 warps and
# registers a thread (a 32-slot block's fp8 is 256 B a thread of 2 warps, 64 registers, as a
# 64-slot block's for 4 warps). Not 8 producer warps: 16 warps launch at 128 registers a thread
# (the register file / 512 threads), and ptxas needs 154 for WG1's 64 x 256 wgmma accumulator.
# 120 each (no spills in an offline sm_90 build at 32-slot blocks; 104 and 112 spill), WG0 216.
REGS_DEQUANT2 = gl.constexpr(120)
# The default schedule (what `sparse_mla` runs, and kernels/variants.py's key): 32-slot blocks and
# the register producer, measured fastest on the H200 at 64 tokens x 64 and x 8 heads (73.5 and
# 62.0 us against 101 and 82 at 64-slot blocks; the staging producer 82-84 and 69-71).
DEFAULT_BLOCK_N = 32
DEFAULT_STAGES = 0


@gluon.constexpr_function
def _fp8_layout(rows, num_warps):
    """[rows, TILE] fp8: 16 bytes a thread, 8 threads a 128-byte row segment (one sector run)."""
    tc = TILE // FP8_VEC
    assert (32 // tc) * num_warps <= rows, f"{rows} slots are too few for {num_warps} warps"
    return gl.BlockedLayout([1, FP8_VEC], [32 // tc, tc], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _stage_layout(rows, cols, num_warps):
    """[rows, cols] fp8 for cp.async: 16 bytes a thread, each element copied by one thread."""
    tc = min(32, cols // FP8_VEC)
    assert (32 // tc) * num_warps <= rows, f"[{rows}, {cols}] is too small for {num_warps} warps of 16-byte copies"
    return gl.BlockedLayout([1, FP8_VEC], [32 // tc, tc], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _scale_layout(num_warps):
    """[rows, 4] fp32 scales for cp.async: one 4-byte scale a thread, the 4 columns across warps
    (rows a multiple of 32: no two threads copy the same element)."""
    return gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [1, 0])


@gluon.jit
def _row_bytes(slot, stride_p, stride_s, PAGE):
    """Byte offset of each slot's row (slots of -1 read row 0, masked by the caller)."""
    slot = gl.where(slot >= 0, slot, 0)
    page = slot // PAGE
    base = page.to(gl.int64) * stride_p + (slot - page * PAGE).to(gl.int64) * stride_s
    return gl.multiple_of(base, 16)  # rows are 656 B apart in a 16-byte-aligned pool


@gluon.jit
def _load_tile(c8_ptr, base, valid, k: gl.constexpr, L: gl.constexpr):
    col = k * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(0, L))
    return gl.load(c8_ptr + base[:, None] + col[None, :], mask=valid[:, None], other=0.0)


@gluon.jit
def _load_scale(sc_ptr, base, valid, k: gl.constexpr, R: gl.constexpr):
    return gl.load(sc_ptr + (base // 4 + (R // 4 + k)), mask=valid, other=0.0)


@gluon.jit
def _store_tile(dst, x, s, valid, k: gl.constexpr):
    # e4m3 -> fp32 is exact, the power-of-two scale is exact, and so is the bf16 rounding of the
    # product (8 significant bits fit in bf16's 8); the where keeps a masked row at zero whatever
    # the masked load left in its registers
    y = gl.where(valid[:, None], x.to(gl.float32) * s[:, None], 0.0)
    dst.slice(k * TILE, TILE, dim=1).store(y.to(dst.dtype))


@gluon.jit
def _gather_rope(dst, rp_ptr, slot, stride_p, stride_s, PAGE, R: gl.constexpr, BN: gl.constexpr,
                 P: gl.constexpr):
    """cp.async the bf16 rope values of the slots' rows into dst [BN, P]; -1 slots zero-filled."""
    L: gl.constexpr = _copy_layout(BN, P, gl.num_warps())
    valid = slot >= 0
    base = _row_bytes(slot, stride_p, stride_s, PAGE)
    # bf16 element offset of the rope part: the row's bytes / 2 plus the rope's offset (R fp8 +
    # R/128 fp32 scales), a multiple of 8 elements, so the copies stay 16 bytes wide
    off = gl.multiple_of(base // 2 + (R + 4 * (R // 128)) // 2, 8)
    c = gl.arange(0, P, layout=gl.SliceLayout(0, L))
    cp.async_copy_global_to_shared(dst, rp_ptr + off[:, None] + c[None, :], mask=valid[:, None])


@gluon.jit
def _dequant_blocks(cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                    stride_p, stride_s, PAGE, FIRST: gl.constexpr, STEP: gl.constexpr):
    """The blocks FIRST, FIRST + STEP, ... < nblk, by this partition's warps (4 or 8)."""
    R: gl.constexpr = cn.shape[2]
    BN: gl.constexpr = cn.shape[1]
    P: gl.constexpr = cr.shape[2]
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(R == 4 * TILE, "the producer is written for four 128-column latent tiles")
    DL: gl.constexpr = _fp8_layout(BN, NW)
    LD: gl.constexpr = gl.SliceLayout(1, DL)
    LR: gl.constexpr = gl.SliceLayout(1, _copy_layout(BN, P, NW))
    s_d = _load_slots(idx_row, start + FIRST * BN, end, BN, LD)
    g_r = _load_slots(idx_row, start + FIRST * BN, end, BN, LR)
    for i in range(FIRST, nblk, STEP):
        b = i % 2
        n_d = _load_slots(idx_row, start + (i + STEP) * BN, end, BN, LD)
        n_r = _load_slots(idx_row, start + (i + STEP) * BN, end, BN, LR)
        # this block's rows, issued before waiting for its buffer: in flight during the wait
        v = s_d >= 0
        base = _row_bytes(s_d, stride_p, stride_s, PAGE)
        x0 = _load_tile(c8_ptr, base, v, 0, DL)
        x1 = _load_tile(c8_ptr, base, v, 1, DL)
        x2 = _load_tile(c8_ptr, base, v, 2, DL)
        x3 = _load_tile(c8_ptr, base, v, 3, DL)
        k0 = _load_scale(sc_ptr, base, v, 0, R)
        k1 = _load_scale(sc_ptr, base, v, 1, R)
        k2 = _load_scale(sc_ptr, base, v, 2, R)
        k3 = _load_scale(sc_ptr, base, v, 3, R)
        mbarrier.wait(c_empty.index(b), ((i // 2) & 1) ^ 1)
        dst = cn.index(b)
        _gather_rope(cr.index(b), rp_ptr, g_r, stride_p, stride_s, PAGE, R, BN, P)
        cp.mbarrier_arrive(c_full.index(b), increment_count=False)
        _store_tile(dst, x0, k0, v, 0)
        _store_tile(dst, x1, k1, v, 1)
        _store_tile(dst, x2, k2, v, 2)
        _store_tile(dst, x3, k3, v, 3)
        fence_async_shared()  # generic-proxy stores, read by wgmma through the async proxy
        gl.thread_barrier()
        mbarrier.arrive(c_full.index(b))
        s_d = n_d
        g_r = n_r


# Worker partitions take no constexpr arguments: which blocks a producer takes is fixed by which
# of these it is.
@gluon.jit
def _ws_dequant(cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                stride_p, stride_s, PAGE):
    _dequant_blocks(cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                    stride_p, stride_s, PAGE, 0, 1)


@gluon.jit
def _ws_dequant_even(cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                     stride_p, stride_s, PAGE):
    _dequant_blocks(cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                    stride_p, stride_s, PAGE, 0, 2)


@gluon.jit
def _ws_dequant_odd(cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                    stride_p, stride_s, PAGE):
    _dequant_blocks(cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                    stride_p, stride_s, PAGE, 1, 2)


@gluon.jit
def _stage_rows(st8, stsc, strp, b8, bs, br, v8, vs, vr, c8_ptr, sc_ptr, rp_ptr, R: gl.constexpr,
                BN: gl.constexpr, P: gl.constexpr):
    """cp.async one block's raw rows into a staging slot: fp8 [BN, R], scales [BN, R/128], rope
    [BN, P] (row byte offsets and validity in each copy's own row layout; -1 rows zero-filled)."""
    L8: gl.constexpr = _stage_layout(BN, R, 4)
    c8 = gl.arange(0, R, layout=gl.SliceLayout(0, L8))
    cp.async_copy_global_to_shared(st8, c8_ptr + b8[:, None] + c8[None, :], mask=v8[:, None])
    LS: gl.constexpr = _scale_layout(4)
    cs = gl.arange(0, R // 128, layout=gl.SliceLayout(0, LS))
    cp.async_copy_global_to_shared(stsc, sc_ptr + (bs // 4 + R // 4)[:, None] + cs[None, :], mask=vs[:, None])
    LR: gl.constexpr = _copy_layout(BN, P, 4)
    cr = gl.arange(0, P, layout=gl.SliceLayout(0, LR))
    off = gl.multiple_of(br // 2 + (R + 4 * (R // 128)) // 2, 8)
    cp.async_copy_global_to_shared(strp, rp_ptr + off[:, None] + cr[None, :], mask=vr[:, None])


@gluon.jit
def _stage_slots(idx_row, j0, end, stride_p, stride_s, PAGE, R: gl.constexpr, BN: gl.constexpr,
                 P: gl.constexpr):
    """Row byte offsets and validity of the slots j0 .. j0 + BN in the three copies' row layouts."""
    s8 = _load_slots(idx_row, j0, end, BN, gl.SliceLayout(1, _stage_layout(BN, R, 4)))
    ss = _load_slots(idx_row, j0, end, BN, gl.SliceLayout(1, _scale_layout(4)))
    sr = _load_slots(idx_row, j0, end, BN, gl.SliceLayout(1, _copy_layout(BN, P, 4)))
    return (_row_bytes(s8, stride_p, stride_s, PAGE), _row_bytes(ss, stride_p, stride_s, PAGE),
            _row_bytes(sr, stride_p, stride_s, PAGE), s8 >= 0, ss >= 0, sr >= 0)


@gluon.jit
def _ws_dequant_staged(cn, cr, st8, stsc, strp, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end,
                       nblk, stride_p, stride_s, PAGE):
    """The producer with a staging ring: raw rows are cp.async'd STAGES - 1 blocks ahead into
    shared memory (no registers held while in flight), then widened from there into the bf16
    tiles. Its own copies only: per-thread commit groups, then a barrier, order the staging."""
    R: gl.constexpr = cn.shape[2]
    BN: gl.constexpr = cn.shape[1]
    P: gl.constexpr = cr.shape[2]
    S: gl.constexpr = st8.shape[0]
    DL: gl.constexpr = _fp8_layout(BN, 4)
    RL: gl.constexpr = _copy_layout(BN, P, 4)
    for j in gl.static_range(S - 1):
        b8, bs, br, v8, vs, vr = _stage_slots(idx_row, start + j * BN, end, stride_p, stride_s, PAGE, R, BN, P)
        _stage_rows(st8.index(j), stsc.index(j), strp.index(j), b8, bs, br, v8, vs, vr, c8_ptr, sc_ptr, rp_ptr,
                    R, BN, P)
        cp.commit_group()
    b8, bs, br, v8, vs, vr = _stage_slots(idx_row, start + (S - 1) * BN, end, stride_p, stride_s, PAGE, R, BN, P)
    for i in range(nblk):
        b = i % 2
        # refill the slot block i - 1 left (every thread finished reading it before the last barrier)
        f = (i + S - 1) % S
        _stage_rows(st8.index(f), stsc.index(f), strp.index(f), b8, bs, br, v8, vs, vr, c8_ptr, sc_ptr, rp_ptr,
                    R, BN, P)
        cp.commit_group()
        b8, bs, br, v8, vs, vr = _stage_slots(idx_row, start + (i + S) * BN, end, stride_p, stride_s, PAGE, R, BN, P)
        cp.wait_group(S - 1)  # this thread's copies of block i have landed
        gl.thread_barrier()  # and every thread's
        g = i % S
        mbarrier.wait(c_empty.index(b), ((i // 2) & 1) ^ 1)
        dst = cn.index(b)
        src = st8.index(g)
        sc = stsc.index(g)
        for k in gl.static_range(R // TILE):
            x = src.slice(k * TILE, TILE, dim=1).load(DL)
            sk = sc.slice(k, 1, dim=1).load(DL)  # [BN, 1]: this tile's scale per row
            dst.slice(k * TILE, TILE, dim=1).store((x.to(gl.float32) * sk).to(dst.dtype))
        cr.index(b).store(strp.index(g).load(RL))
        fence_async_shared()  # generic-proxy stores, read by wgmma through the async proxy
        gl.thread_barrier()
        mbarrier.arrive(c_full.index(b))


@gluon.jit
def _ws_scores_after_q(qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar,
                       idx_row, start, end, nblk, qk_scale, out_ptr, part_ptr, lse_ptr, t, hb, sp, nsp,
                       stride_ot, stride_oh, H: gl.constexpr, R: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                       SPLIT: gl.constexpr):
    """`_ws_scores` once this warpgroup's cp.async copies of q have landed (every thread's, and
    visible to wgmma)."""
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    _ws_scores(qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar,
               idx_row, start, end, nblk, qk_scale, out_ptr, part_ptr, lse_ptr, t, hb, sp, nsp,
               stride_ot, stride_oh, H, R, BH, BN, SPLIT)


@gluon.jit
def _sparse_mla_fp8_hopper_kernel(
    q_ptr, c8_ptr, sc_ptr, rp_ptr, idx_ptr, out_ptr, part_ptr, lse_ptr,
    K, qk_scale, split_len,
    stride_qt, stride_qh, stride_p, stride_s, stride_it, stride_ot, stride_oh,
    H: gl.constexpr, R: gl.constexpr, P: gl.constexpr, PAGE: gl.constexpr,
    BH: gl.constexpr, BN: gl.constexpr, NHB: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
    PWARPS: gl.constexpr, NPROD: gl.constexpr, num_warps: gl.constexpr,
):
    # STAGES 0: `_ws_dequant` (fp8 rows through registers) in NPROD partitions of PWARPS warps
    # (NPROD 2: alternate blocks, so each buffer has one producer); else `_ws_dequant_staged`
    # with that many staging slots
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    pid = gl.program_id(0)
    sp = gl.program_id(1)
    nsp = gl.num_programs(1)
    t = pid // NHB
    hb = pid % NHB
    # c_full, STAGES 0: the filling partition's threads' rope cp.async + the latent stores; else the
    # stores only
    C_FULL: gl.constexpr = 1 if STAGES > 0 else 32 * PWARPS + 1
    qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar = _program_buffers(dtype, BH, BN, R, P,
                                                                                              C_FULL)
    start, end, nblk, idx_row = _copy_query(qn, qr, q_ptr, idx_ptr, t, hb, sp, split_len, K, stride_qt, stride_qh,
                                            stride_it, H, R, P, BH, BN, num_warps)
    # q is waited for in `_ws_scores_after_q` (these warps are the default partition): the
    # producer's first gathers start while q is still in flight
    fence_async_shared()  # the barrier inits, before any partition uses them
    gl.thread_barrier()

    if STAGES > 0:
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        st8 = gl.allocate_shared_memory(c8_ptr.dtype.element_ty, [STAGES, BN, R], flat)
        stsc = gl.allocate_shared_memory(gl.float32, [STAGES, BN, R // 128], flat)
        strp = gl.allocate_shared_memory(dtype, [STAGES, BN, P], flat)
        gl.warp_specialize([
            (_ws_scores_after_q, (qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar,
                          idx_row, start, end, nblk, qk_scale, out_ptr, part_ptr, lse_ptr, t, hb, sp, nsp,
                          stride_ot, stride_oh, H, R, BH, BN, SPLIT)),
            (_ws_values_hi, (cn, ps, al, fin, c_empty, p_full, p_empty, fin_bar, nblk, out_ptr, part_ptr, t, hb,
                             sp, nsp, stride_ot, stride_oh, H)),
            (_ws_dequant_staged, (cn, cr, st8, stsc, strp, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start,
                                  end, nblk, stride_p, stride_s, PAGE)),
        ], [4, 4], [REGS_VALUES, REGS_STAGED])
    elif NPROD == 2:  # two PWARPS-warp partitions, the even and the odd blocks
        gl.warp_specialize([
            (_ws_scores_after_q, (qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar,
                          idx_row, start, end, nblk, qk_scale, out_ptr, part_ptr, lse_ptr, t, hb, sp, nsp,
                          stride_ot, stride_oh, H, R, BH, BN, SPLIT)),
            (_ws_values_hi, (cn, ps, al, fin, c_empty, p_full, p_empty, fin_bar, nblk, out_ptr, part_ptr, t, hb,
                             sp, nsp, stride_ot, stride_oh, H)),
            (_ws_dequant_even, (cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                                stride_p, stride_s, PAGE)),
            (_ws_dequant_odd, (cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                               stride_p, stride_s, PAGE)),
        ], [4, PWARPS, PWARPS], [REGS_VALUES, REGS_DEQUANT2, REGS_DEQUANT2])
    else:
        gl.warp_specialize([
            (_ws_scores_after_q, (qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar,
                          idx_row, start, end, nblk, qk_scale, out_ptr, part_ptr, lse_ptr, t, hb, sp, nsp,
                          stride_ot, stride_oh, H, R, BH, BN, SPLIT)),
            (_ws_values_hi, (cn, ps, al, fin, c_empty, p_full, p_empty, fin_bar, nblk, out_ptr, part_ptr, t, hb,
                             sp, nsp, stride_ot, stride_oh, H)),
            (_ws_dequant, (cn, cr, c_full, c_empty, c8_ptr, sc_ptr, rp_ptr, idx_row, start, end, nblk,
                           stride_p, stride_s, PAGE)),
        ], [4, 4], [REGS_VALUES, REGS_DEQUANT])


def fp8_hopper_shape_ok(dtype: torch.dtype, kv_lora_rank: int, qk_dim: int) -> bool:
    """The dtype and shapes without the device (kernels/variants.py may ask it): bf16 queries and
    the GLM-5 latent row (512 + 64, 656 B in the cache); any head count."""
    return dtype == torch.bfloat16 and kv_lora_rank == KV_LORA_RANK and qk_dim == KV_LORA_RANK + ROPE_DIM


def fp8_hopper_supports(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """A CUDA sm_90 device, an FP8 cache of whole 656 B rows at 16-byte-aligned strides (the loads
    are 16 bytes wide), and `fp8_hopper_shape_ok`."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9 or kv_cache.dtype != torch.uint8:
        return False
    if not fp8_hopper_shape_ok(q.dtype, kv_lora_rank, q.shape[2]) or q.stride(2) != 1:
        return False
    if q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:  # q rows are copied 16 bytes at a time
        return False
    bpt = LatentLayout(kv_lora_rank, q.shape[2] - kv_lora_rank).bytes_per_token
    return (kv_cache.dim() == 3 and kv_cache.shape[2] == bpt and kv_cache.stride(2) == 1
            and kv_cache.stride(0) % 16 == 0 and kv_cache.stride(1) % 16 == 0 and kv_cache.data_ptr() % 16 == 0)


def sparse_mla_fp8_hopper(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    stages: int | None = None,
    producers: int = 1,
    keep_splits: bool = False,
) -> torch.Tensor | Splits:
    """`sparse_mla` over one layer's FP8 cache [num_pages, page_size, 656] uint8 (check
    `fp8_hopper_supports` first). Splits are planned and combined as for the bf16 kernels
    (`sparse_mla_triton.plan_splits` / `combine_splits`). The options change the speed, not the
    result: `num_splits`, `block_n` (32 or 64) and `stages`: 0 for the producer that loads the
    rows into registers, 2 or 3 for the one that stages them in shared memory (`block_n` 32 only:
    64-slot tiles leave no room for staging). Neither given: DEFAULT_BLOCK_N and DEFAULT_STAGES.
    `producers`: the register producer's 4 warps as one partition, or (2, `block_n` 32) as two of
    2 warps taking alternate blocks, each with its own block's rows in flight: two blocks loading
    at once where one partition has one, and one partition's loads overlap the other's stores.
    `keep_splits`: as `sparse_mla_triton`'s."""
    assert fp8_hopper_supports(q, kv_cache, kv_lora_rank), "needs sm_90, bf16 q, the 512 + 64 latent, 656 B rows"
    if block_n is None and stages is None:
        block_n, stages = DEFAULT_BLOCK_N, DEFAULT_STAGES
    block_n = block_n or (32 if stages else DEFAULT_BLOCK_N)
    stages = stages or 0
    assert block_n in (32, 64), "the slot block is 32 or 64 (64 fills shared memory)"
    assert stages == 0 or (block_n == 32 and stages in (2, 3)), "staging takes 2 or 3 slots of 32-slot blocks"
    assert producers == 1 or (producers == 2 and stages == 0 and block_n == 32), \
        "two producer partitions: the register producer at 32-slot blocks (64 needs 128 registers a thread)"
    T, H, Dqk = q.shape
    R = kv_lora_rank
    out, indices = launch_inputs(q, indices, R)
    if T == 0:
        return out
    c8, sc, rp = views(kv_cache, LatentLayout(R, Dqk - R))
    K = indices.shape[1]
    nhb = -(-H // BLOCK_H)
    num_splits, split_len, part, lse = plan_splits(q, out, K, nhb, block_n, num_splits, R)
    _sparse_mla_fp8_hopper_kernel[(T * nhb, num_splits)](
        q, c8, sc, rp, indices, out, part, lse, K, sm_scale * LOG2E, split_len,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), indices.stride(0),
        out.stride(0), out.stride(1),
        H=H, R=R, P=Dqk - R, PAGE=kv_cache.shape[1], BH=BLOCK_H, BN=block_n, NHB=nhb, SPLIT=num_splits > 1,
        STAGES=stages, PWARPS=4 // producers, NPROD=producers, num_warps=4, maxnreg=MAXNREG,
    )
    return finish_splits(out, part, lse, num_splits, R, R, keep_splits)

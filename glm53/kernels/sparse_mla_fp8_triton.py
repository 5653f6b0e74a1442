"""Triton sparse MLA decode/verify over the FP8 latent cache (`latent_cache_fp8`, 656 B/token for GLM-5).

Same contract, grid, split planning and combine as `sparse_mla_triton` (whose `_combine_kernel`
it launches); the difference is the row it gathers: per selected slot, the fp8 latent as NT
column tiles of TILE (128) plus one fp32 scale per tile, and the bf16 rope part. The fp8 values
are widened to q's dtype (exact) and the scales never touch the [slots, R] tile:
- scores: `s = Σ_i (q_i · c_i^T) · scale_i[slot] + q_pe · k_pe^T`, the scale applied to the
  [heads, slots] partial product of tile i;
- values: `acc_i += (p · scale_i[slot]) · c_i`, the scale folded into the softmax weights.
The scales are powers of two (ue8m0), so both products are exact in bf16, and the kernel computes
attention over the dequantized cache (what `sparse_mla_reference` does on the gathered rows).

Up to four tiles (R <= 512: GLM-5 and the tiny configs); a wider latent is refused. On sm_90 at
GLM-5's row `sparse_mla` runs the Gluon kernel `sparse_mla_fp8_hopper` instead; this portable
kernel runs every other FP8 case (and CI's, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, triton_interpreting
from glm53.kernels.latent_cache_fp8 import LatentLayout, views
from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.sparse_mla_triton import LOG2E, Splits, default_tiles, finish_splits, launch_inputs, plan_splits

MAX_TILES = 4


@triton.jit
def _load_tile(c_row, valid, k: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr):
    """fp8 columns [k·TILE, (k+1)·TILE) of the rows at `c_row` ([BLOCK_N] pointers)."""
    t = tl.arange(0, BLOCK_T)
    col = k * TILE + t
    m = (t < TILE) & (col < R)
    return tl.load(c_row[:, None] + col[None, :], mask=valid[:, None] & m[None, :], other=0.0)


@triton.jit
def _load_q_tile(q_row, hm, k: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
                 DOT_F32: tl.constexpr):
    t = tl.arange(0, BLOCK_T)
    col = k * TILE + t
    m = (t < TILE) & (col < R)
    qk = tl.load(q_row + col[None, :], mask=hm[:, None] & m[None, :], other=0.0)
    if DOT_F32:
        qk = qk.to(tl.float32)
    return qk


@triton.jit
def _store_tile(row_ptr, o, hm, k: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.arange(0, BLOCK_T)
    col = k * TILE + t
    m = (t < TILE) & (col < R)
    tl.store(row_ptr + col[None, :], o.to(row_ptr.dtype.element_ty), mask=hm[:, None] & m[None, :])


@triton.jit
def _sparse_mla_fp8_kernel(
    q_ptr, c_ptr, idx_ptr, out_ptr, part_ptr, lse_ptr,
    K, qk_scale, split_len,
    stride_qt, stride_qh, stride_p1, stride_s1,
    stride_it, stride_ot, stride_oh,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr,
    NT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, SOFF: tl.constexpr, ROFF: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NHB: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    t = pid // NHB
    hb = pid % NHB
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    p = tl.arange(0, BLOCK_P)
    pm = p < P
    q_row = q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_pe = tl.load(q_row + R + p[None, :], mask=hm[:, None] & pm[None, :], other=0.0)
    if DOT_F32:
        q_pe = q_pe.to(tl.float32)
    cdt = q_pe.dtype  # the dtype the products run in: q's (fp32 in the interpreter)
    q0 = _load_q_tile(q_row, hm, 0, R, TILE, BLOCK_T, DOT_F32)
    acc0 = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
    if NT > 1:
        q1 = _load_q_tile(q_row, hm, 1, R, TILE, BLOCK_T, DOT_F32)
        acc1 = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
    if NT > 2:
        q2 = _load_q_tile(q_row, hm, 2, R, TILE, BLOCK_T, DOT_F32)
        acc2 = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
    if NT > 3:
        q3 = _load_q_tile(q_row, hm, 3, R, TILE, BLOCK_T, DOT_F32)
        acc3 = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, K)
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + j, mask=j < end, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        page = slot // PAGE
        off = slot - page * PAGE
        pg = page.to(tl.int64)
        # One byte address per row; the scales and the rope part are reinterpreted from it (their
        # byte offsets and the 656 B row stride are multiples of 16, so the loads stay vectorized)
        c_row = c_ptr + pg * stride_p1 + off * stride_s1
        s_row = (c_row + SOFF).to(tl.pointer_type(tl.float32), bitcast=True)
        r_row = (c_row + ROFF).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        kpe = tl.load(r_row[:, None] + p[None, :], mask=valid[:, None] & pm[None, :], other=0.0).to(cdt)
        s = tl.dot(q_pe, tl.trans(kpe), input_precision=PRECISION)
        c0 = _load_tile(c_row, valid, 0, R, TILE, BLOCK_T).to(cdt)
        sc0 = tl.load(s_row, mask=valid, other=0.0)
        s += tl.dot(q0, tl.trans(c0), input_precision=PRECISION) * sc0[None, :]
        if NT > 1:
            c1 = _load_tile(c_row, valid, 1, R, TILE, BLOCK_T).to(cdt)
            sc1 = tl.load(s_row + 1, mask=valid, other=0.0)
            s += tl.dot(q1, tl.trans(c1), input_precision=PRECISION) * sc1[None, :]
        if NT > 2:
            c2 = _load_tile(c_row, valid, 2, R, TILE, BLOCK_T).to(cdt)
            sc2 = tl.load(s_row + 2, mask=valid, other=0.0)
            s += tl.dot(q2, tl.trans(c2), input_precision=PRECISION) * sc2[None, :]
        if NT > 3:
            c3 = _load_tile(c_row, valid, 3, R, TILE, BLOCK_T).to(cdt)
            sc3 = tl.load(s_row + 3, mask=valid, other=0.0)
            s += tl.dot(q3, tl.trans(c3), input_precision=PRECISION) * sc3[None, :]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        pr = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        m_i = m_new
        # a power-of-two scale times p is exact in bf16: fold the scale in after rounding p
        acc0 = tl.dot((pr * sc0[None, :]).to(cdt), c0, acc0 * alpha[:, None], input_precision=PRECISION)
        if NT > 1:
            acc1 = tl.dot((pr * sc1[None, :]).to(cdt), c1, acc1 * alpha[:, None], input_precision=PRECISION)
        if NT > 2:
            acc2 = tl.dot((pr * sc2[None, :]).to(cdt), c2, acc2 * alpha[:, None], input_precision=PRECISION)
        if NT > 3:
            acc3 = tl.dot((pr * sc3[None, :]).to(cdt), c3, acc3 * alpha[:, None], input_precision=PRECISION)

    has = l_i > 0.0
    inv = (1.0 / tl.where(has, l_i, 1.0))[:, None]
    if SPLIT:
        nsp = tl.num_programs(1)
        prow = (t.to(tl.int64) * H + h) * nsp + sp  # [T, H, S] layout
        row = part_ptr + prow[:, None] * BLOCK_R
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + prow, lse, mask=hm)
    else:
        row = out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh
    _store_tile(row, acc0 * inv, hm, 0, R, TILE, BLOCK_T)
    if NT > 1:
        _store_tile(row, acc1 * inv, hm, 1, R, TILE, BLOCK_T)
    if NT > 2:
        _store_tile(row, acc2 * inv, hm, 2, R, TILE, BLOCK_T)
    if NT > 3:
        _store_tile(row, acc3 * inv, hm, 3, R, TILE, BLOCK_T)


def default_block_n(T: int) -> int:
    """Slots per block for T query tokens (the schedule below; kernels/variants.py asks it)."""
    return 16 if triton_interpreting() else (64 if T >= 16 else 32)


def sparse_mla_fp8_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    keep_splits: bool = False,
) -> torch.Tensor | Splits:
    """`kv_cache` [num_pages, page_size, bytes_per_token] uint8 (one layer's view of an FP8 latent
    pool); the schedule options (None: defaults) change the speed, not the result. `keep_splits`:
    as `sparse_mla_triton`'s."""
    T, H, Dqk = q.shape
    R = kv_lora_rank
    P = Dqk - R
    layout = LatentLayout(R, P)
    assert layout.n_tiles <= MAX_TILES, f"the FP8 kernel takes at most {MAX_TILES} latent tiles, R={R} needs {layout.n_tiles}"
    assert q.stride(2) == 1, "the latent dim must be contiguous"
    c8 = views(kv_cache, layout)[0]
    page_size = kv_cache.shape[1]
    K = indices.shape[1]
    out, indices = launch_inputs(q, indices, R)
    if T == 0:
        return out
    interp = triton_interpreting()
    BLOCK_T = max(16, triton.next_power_of_2(layout.tile))
    BLOCK_R, BLOCK_P, block_h, warps = default_tiles(H, R, P, block_h, interp)
    # Schedule measured on the H200 at GLM-5 shapes (benchmarks/fp8_kv.py, CUDA-graph timed): one
    # query token 17 us at 32-slot blocks against 22 at 64; 64 tokens 175 us at 64-slot blocks and
    # 2 stages against 180-237 for the other schedules tried; 8 warps throughout.
    if block_n is None:
        block_n = default_block_n(T)
    num_warps = num_warps or warps
    if num_stages is None:
        num_stages = 1 if interp else 2
    nhb = triton.cdiv(H, block_h)
    num_splits, split_len, part, lse = plan_splits(q, out, K, nhb, block_n, num_splits, BLOCK_R)
    _sparse_mla_fp8_kernel[(T * nhb, num_splits)](
        q, c8, indices, out, part, lse,
        K, sm_scale * LOG2E, split_len,
        q.stride(0), q.stride(1), c8.stride(0), c8.stride(1), indices.stride(0), out.stride(0), out.stride(1),
        H=H, R=R, P=P, TILE=layout.tile, BLOCK_T=BLOCK_T, NT=layout.n_tiles, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P,
        SOFF=layout.scale_offset, ROFF=layout.rope_offset, PAGE=page_size, BLOCK_H=block_h,
        BLOCK_N=block_n, NHB=nhb, SPLIT=num_splits > 1, DOT_F32=interp,
        PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages, **early_args(),
    )
    return finish_splits(out, part, lse, num_splits, R, BLOCK_R, keep_splits)

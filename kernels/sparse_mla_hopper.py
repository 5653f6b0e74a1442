"""Sparse MLA decode/verify for Hopper (sm_90), written in Gluon: explicit layouts and pipeline.

Same contract and split/combine as `sparse_mla_triton` (which stays the portable kernel and the
one CI runs under TRITON_INTERPRET=1; Gluon has no interpreter). Why a second kernel: for the
GLM-5 shape (64 heads, 512 + 64 latent, 2048 slots) the `tl` kernel reached only ~37% of HBM.
Triton's layout pass gives a dot that feeds another dot all warps along M, so with 64 heads on two
warpgroups both computed the same 64 x BN score tile, and its pipeliner issued a block's gathers
only after the previous block's compute. Here (one program = one token, 64 heads, one share of
the slots; 8 warps):
- the score tile S = q·c^T is split along the slots between the two warpgroups (no duplicate
  tensor work); each warpgroup then owns half of the 512 output columns for O += P·c;
- the gathered latent rows live in an NBUF-deep shared-memory ring filled by cp.async: the rows of
  block i + NBUF - 1 are requested before block i is computed;
- the row sums stay per column ([64, BN] registers) and are reduced once at the end; only the row
  max crosses warpgroups each block, and P goes through shared memory (the PV dot's A operand
  needs all of a row's slots).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

BLOCK_H = 64  # heads per program: one wgmma row tile per warpgroup
NUM_WARPS = 8
VEC = gl.constexpr(8)  # 16-byte cp.async vectors of a 16-bit dtype


@gluon.constexpr_function
def _copy_layout(rows, cols, num_warps):
    """A blocked layout for [rows, cols] that gives every thread whole 16-byte vectors and every
    element to exactly one thread (cp.async must not duplicate a destination)."""
    tc = min(32, cols // VEC)
    assert (32 // tc) * num_warps <= rows, f"[{rows}, {cols}] is too small for {num_warps} warps of 16-byte copies"
    return gl.BlockedLayout([1, VEC], [32 // tc, tc], [num_warps, 1], [1, 0])


@gluon.jit
def _load_slots(idx_row, j0, end, BN: gl.constexpr, layout: gl.constexpr):
    """The slots j0 .. j0 + BN of a token's selection (-1 past `end`), in `layout`. Loaded one
    iteration before use: a load whose result feeds the next instruction stalls the warp."""
    j = j0 + gl.arange(0, BN, layout=layout)
    return gl.load(idx_row + j, mask=j < end, other=-1)


@gluon.jit
def _gather_rows(dst, kv_ptr, slot, stride_kp, stride_ks, col0,
                 COLS: gl.constexpr, BN: gl.constexpr, PAGE: gl.constexpr, num_warps: gl.constexpr):
    """cp.async the columns [col0, col0 + COLS) of the latent rows of `slot` (from `_load_slots`
    in `_copy_layout(BN, COLS)`'s rows) into dst; slots of -1 are zero-filled, never read."""
    L: gl.constexpr = _copy_layout(BN, COLS, num_warps)
    valid = slot >= 0
    slot = gl.where(valid, slot, 0)
    page = slot // PAGE  # a constant page size: shifts, not a 64-bit division per row
    base = page.to(gl.int64) * stride_kp + (slot - page * PAGE) * stride_ks + col0
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, L))
    cp.async_copy_global_to_shared(dst, kv_ptr + base[:, None] + c[None, :], mask=valid[:, None])


@gluon.jit
def _sparse_mla_hopper_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, part_ptr, lse_ptr,
    K, qk_scale, split_len,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_it, stride_ot, stride_oh,
    H: gl.constexpr, R: gl.constexpr, P: gl.constexpr, PAGE: gl.constexpr,
    BH: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, NHB: gl.constexpr, SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # S [BH, BN]: the warpgroups split the slots; O [BH, R]: they split the output columns.
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, R // 2, 16])
    QN_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, R], dtype)
    QR_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, P], dtype)
    CN_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, R], dtype)
    CR_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, P], dtype)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], dtype)

    pid = gl.program_id(0)
    sp = gl.program_id(1)
    t = pid // NHB
    hb = pid % NHB
    qn = gl.allocate_shared_memory(dtype, [BH, R], QN_S)
    qr = gl.allocate_shared_memory(dtype, [BH, P], QR_S)
    cn = gl.allocate_shared_memory(dtype, [NBUF, BN, R], CN_S)
    cr = gl.allocate_shared_memory(dtype, [NBUF, BN, P], CR_S)
    ps = gl.allocate_shared_memory(dtype, [BH, BN], P_S)

    start = sp * split_len
    end = gl.minimum(start + split_len, K)
    nblk = gl.cdiv(end - start, BN)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it

    # prologue: the query rows and the first NBUF - 1 blocks, one commit group each
    QL: gl.constexpr = _copy_layout(BH, R, num_warps)
    hq = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, QL))
    QLR: gl.constexpr = _copy_layout(BH, P, num_warps)
    hqr = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, QLR))
    q_tok = q_ptr + t.to(gl.int64) * stride_qt
    cq = gl.arange(0, R, layout=gl.SliceLayout(0, QL))
    cp.async_copy_global_to_shared(qn, q_tok + hq[:, None] * stride_qh + cq[None, :], mask=(hq < H)[:, None])
    cqr = gl.arange(0, P, layout=gl.SliceLayout(0, QLR))
    cp.async_copy_global_to_shared(qr, q_tok + hqr[:, None] * stride_qh + R + cqr[None, :], mask=(hqr < H)[:, None])
    LN: gl.constexpr = gl.SliceLayout(1, _copy_layout(BN, R, num_warps))
    LR: gl.constexpr = gl.SliceLayout(1, _copy_layout(BN, P, num_warps))
    LS: gl.constexpr = gl.SliceLayout(0, S_L)
    for b in gl.static_range(NBUF - 1):
        if b < nblk:
            j0 = start + b * BN
            _gather_rows(cn.index(b), kv_ptr, _load_slots(idx_row, j0, end, BN, LN), stride_kp, stride_ks, 0,
                         R, BN, PAGE, num_warps)
            _gather_rows(cr.index(b), kv_ptr, _load_slots(idx_row, j0, end, BN, LR), stride_kp, stride_ks, R,
                         P, BN, PAGE, num_warps)
        cp.commit_group()
    # the slots of the next block to gather and of the block to score, always loaded one iteration
    # ahead
    g_n = _load_slots(idx_row, start + (NBUF - 1) * BN, end, BN, LN)
    g_r = _load_slots(idx_row, start + (NBUF - 1) * BN, end, BN, LR)
    s_slot = _load_slots(idx_row, start, end, BN, LS)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l2 = gl.zeros([BH, BN], gl.float32, S_L)  # per-column partial row sums, reduced once at the end
    acc = gl.zeros([BH, R], gl.float32, O_L)
    for i in range(nblk):
        buf = i % NBUF
        nxt = i + NBUF - 1
        s_next = _load_slots(idx_row, start + (i + 1) * BN, end, BN, LS)
        cp.wait_group(NBUF - 2)  # this thread's copies of block i have landed ...
        fence_async_shared()  # ... are visible to the tensor cores' (async) proxy ...
        gl.thread_barrier()  # ... and so are every thread's; and every warp is done with block i - 1
        if nxt < nblk:  # into the buffer block i - 1 used
            _gather_rows(cn.index(nxt % NBUF), kv_ptr, g_n, stride_kp, stride_ks, 0, R, BN, PAGE, num_warps)
            _gather_rows(cr.index(nxt % NBUF), kv_ptr, g_r, stride_kp, stride_ks, R, P, BN, PAGE, num_warps)
        cp.commit_group()
        g_n = _load_slots(idx_row, start + (nxt + 1) * BN, end, BN, LN)
        g_r = _load_slots(idx_row, start + (nxt + 1) * BN, end, BN, LR)

        s = warpgroup_mma(qn, cn.index(buf).permute((1, 0)), gl.zeros([BH, BN], gl.float32, S_L), use_acc=False,
                          is_async=True)
        s = warpgroup_mma(qr, cr.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = gl.where((s_slot >= 0)[None, :], s * qk_scale, float("-inf"))
        s_slot = s_next
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l2 = l2 * alpha[:, None] + p
        m_i = m_new
        ps.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # P's halves from both warpgroups, before either reads the whole rows
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(ps, cn.index(buf), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
    cp.wait_group(0)

    l_i = gl.sum(l2, axis=1)
    has = l_i > 0.0
    inv = 1.0 / gl.where(has, l_i, 1.0)
    o = acc * gl.convert_layout(inv, gl.SliceLayout(1, O_L))[:, None]
    h = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    r = gl.arange(0, R, layout=gl.SliceLayout(0, O_L))
    hm = (h < H)[:, None]
    if SPLIT:  # normalized partial output and base-2 log-sum-exp, for sparse_mla_triton's combine
        nsp = gl.num_programs(1)
        prow = (t.to(gl.int64) * H + h) * nsp + sp  # [T, H, S]
        gl.store(part_ptr + prow[:, None] * R + r[None, :], o, mask=hm)
        lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        hs = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        gl.store(lse_ptr + (t.to(gl.int64) * H + hs) * nsp + sp, lse, mask=hs < H)
    else:
        out_row = out_ptr + t.to(gl.int64) * stride_ot + h[:, None] * stride_oh
        gl.store(out_row + r[None, :], o.to(dtype), mask=hm)


def hopper_supports(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """The shapes this kernel is built for: a CUDA sm_90 device, 16-bit operands, heads in whole
    64-row tiles, a power-of-two latent part wgmma can tile (64..512) and a 64-wide rope part
    (the shared-memory budget of q plus two 64-slot buffers is sized for 512 + 64)."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    R, P = kv_lora_rank, q.shape[2] - kv_lora_rank
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    return (q.dtype in (torch.bfloat16, torch.float16) and kv_cache.dtype == q.dtype
            and q.shape[1] % BLOCK_H == 0 and pow2(R) and 64 <= R <= 512 and P == 64)


def sparse_mla_hopper(q, kv_cache, indices, out, part, lse, qk_scale, split_len, R, num_splits, block_n,
                      num_buffers):
    """Launch over (T x head blocks, splits); `sparse_mla_triton` plans the splits, allocates the
    partial outputs ([T, H, S, R] fp32 and [T, H, S] log-sum-exps, as for its own kernel) and
    combines them."""
    T, H, _ = q.shape
    P = q.shape[2] - R
    nhb = H // BLOCK_H
    _sparse_mla_hopper_kernel[(T * nhb, num_splits)](
        q, kv_cache, indices, out, part, lse,
        indices.shape[1], qk_scale, split_len,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), indices.stride(0),
        out.stride(0), out.stride(1),
        H=H, R=R, P=P, PAGE=kv_cache.shape[1], BH=BLOCK_H, BN=block_n, NBUF=num_buffers, NHB=nhb, SPLIT=num_splits > 1,
        num_warps=NUM_WARPS,
    )

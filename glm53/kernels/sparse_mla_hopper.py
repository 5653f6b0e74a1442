"""Sparse MLA decode/verify for Hopper (sm_90), written in Gluon: warp-specialized, explicit layouts.

Same contract and split/combine as `sparse_mla_triton` (which stays the portable kernel and the
one CI runs under TRITON_INTERPRET=1; Gluon has no interpreter). Why a second kernel: at the GLM-5
shape (64 heads, 512 + 64 latent, 2048 slots) the `tl` kernel reached only ~37% of HBM. Triton's
layout pass gives a dot that feeds another dot all warps along M, so with 64 heads on two
warpgroups both computed the same 64 x BN score tile, and its pipeliner issued a block's gathers
only after the previous block's compute.

One program = one token, 64 heads, one share of the slots, three partitions of 4 warps that hand
off through shared memory and mbarriers:
- `_ws_scores` (WG0, the default partition): the whole 64 x BN score tile per block (q read from
  shared memory once per block, the row max inside one warpgroup), the online softmax, P and its
  rescale factors into shared memory, then the low half of the output columns (O += P·c);
- `_ws_values_hi` (WG1): the high half of the output columns, from the same P;
- `_ws_producer`: the gathers of each block's latent rows into a two-deep ring (cp.async, each
  thread's completion arriving on the buffer's mbarrier), issued as soon as both halves are done
  with a buffer, so the next block's rows stream in while this one is computed.
Shared memory: q (72 KB) + two 64-slot buffers (144 KB) + P (8 KB) of the 227 KB. Measured on the
H200 against the previous 8-warp single-role version of this kernel (scores split between the
warpgroups, a cross-warpgroup row max, gathers issued by the compute warps): 61-62 us against 71 at
64 tokens x 64 heads, 89 us against 120 at 128 heads.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

BLOCK_H = 64  # heads per program: one wgmma row tile (a warpgroup)
VEC = gl.constexpr(8)  # 16-byte cp.async vectors of a 16-bit dtype
# Registers: 12 warps x MAXNREG is the whole register file; WG1 (a 64 x 256 fp32 accumulator)
# and the producer get these, WG0 what is left (256: its accumulator, scores and row sums).
MAXNREG = 168
REGS_VALUES = gl.constexpr(168)
REGS_PRODUCER = gl.constexpr(96)


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
                 COLS: gl.constexpr, BN: gl.constexpr, PAGE, num_warps: gl.constexpr):
    """cp.async the columns [col0, col0 + COLS) of the latent rows of `slot` (from `_load_slots`
    in `_copy_layout(BN, COLS)`'s rows) into dst; slots of -1 are zero-filled, never read."""
    L: gl.constexpr = _copy_layout(BN, COLS, num_warps)
    valid = slot >= 0
    slot = gl.where(valid, slot, 0)
    page = slot // PAGE  # int32 (the producer gets PAGE at run time: worker partitions take no constexprs)
    base = page.to(gl.int64) * stride_kp + (slot - page * PAGE) * stride_ks + col0
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, L))
    cp.async_copy_global_to_shared(dst, kv_ptr + base[:, None] + c[None, :], mask=valid[:, None])


@gluon.jit
def _ws_scores(qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar,
               idx_row, start, end, nblk, qk_scale, out_ptr, part_ptr, lse_ptr, t, hb, sp, nsp,
               stride_ot, stride_oh,
               H: gl.constexpr, R: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr):
    dtype: gl.constexpr = qn.dtype
    RH: gl.constexpr = R // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, RH, 16])
    LS: gl.constexpr = gl.SliceLayout(0, S_L)
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l2 = gl.zeros([BH, BN], gl.float32, S_L)
    acc = gl.zeros([BH, RH], gl.float32, O_L)
    s_slot = _load_slots(idx_row, start, end, BN, LS)
    for i in range(nblk):
        b = i % 2
        s_next = _load_slots(idx_row, start + (i + 1) * BN, end, BN, LS)
        mbarrier.wait(c_full.index(b), (i // 2) & 1)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
        s = warpgroup_mma(qn, cn.index(b).permute((1, 0)), gl.zeros([BH, BN], gl.float32, S_L), use_acc=False,
                          is_async=True)
        s = warpgroup_mma(qr, cr.index(b).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = gl.where((s_slot >= 0)[None, :], s * qk_scale, float("-inf"))
        s_slot = s_next
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l2 = l2 * alpha[:, None] + p
        m_i = m_new
        mbarrier.wait(p_empty, (i & 1) ^ 1)  # WG1 is done with the previous P
        ps.store(p.to(dtype))
        al.store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_full)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(ps, cn.index(b).slice(0, RH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(c_empty.index(b))
    l_i = gl.sum(l2, axis=1)
    has = l_i > 0.0
    inv = 1.0 / gl.where(has, l_i, 1.0)
    mbarrier.wait(p_empty, (nblk & 1) ^ 1)  # WG1 has taken the last P and alpha
    fin.store(inv)
    gl.thread_barrier()
    mbarrier.arrive(fin_bar)
    o = acc * gl.convert_layout(inv, gl.SliceLayout(1, O_L))[:, None]
    _ws_store(o, out_ptr, part_ptr, t, hb, sp, nsp, 0, stride_ot, stride_oh, H, R, BH, O_L)
    if SPLIT:
        lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        hs = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        gl.store(lse_ptr + (t.to(gl.int64) * H + hs) * nsp + sp, lse, mask=hs < H)


@gluon.jit
def _ws_store(o, out_ptr, part_ptr, t, hb, sp, nsp, col0, stride_ot, stride_oh, H,
              R: gl.constexpr, BH: gl.constexpr, O_L: gl.constexpr):
    h = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    r = col0 + gl.arange(0, R // 2, layout=gl.SliceLayout(0, O_L))
    hm = (h < H)[:, None]
    if nsp > 1:
        prow = (t.to(gl.int64) * H + h) * nsp + sp
        gl.store(part_ptr + prow[:, None] * R + r[None, :], o, mask=hm)
    else:
        out_row = out_ptr + t.to(gl.int64) * stride_ot + h[:, None] * stride_oh
        gl.store(out_row + r[None, :], o.to(out_ptr.dtype.element_ty), mask=hm)


@gluon.jit
def _ws_values_hi(cn, ps, al, fin, c_empty, p_full, p_empty, fin_bar, nblk, out_ptr, part_ptr, t, hb, sp, nsp,
                  stride_ot, stride_oh, H):
    # worker partitions get no constexpr arguments: the shapes come from the buffers' types
    BH: gl.constexpr = ps.shape[0]
    R: gl.constexpr = cn.shape[2]
    RH: gl.constexpr = R // 2
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, RH, 16])
    acc = gl.zeros([BH, RH], gl.float32, O_L)
    for i in range(nblk):
        b = i % 2
        mbarrier.wait(p_full, i & 1)
        fence_async_shared()
        alpha = al.load(gl.SliceLayout(1, O_L))
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(ps, cn.index(b).slice(RH, RH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(p_empty)
        mbarrier.arrive(c_empty.index(b))
    mbarrier.wait(fin_bar, 0)
    inv = fin.load(gl.SliceLayout(1, O_L))
    _ws_store(acc * inv[:, None], out_ptr, part_ptr, t, hb, sp, nsp, RH, stride_ot, stride_oh, H, R, BH, O_L)


@gluon.jit
def _ws_producer(cn, cr, c_full, c_empty, kv_ptr, idx_row, start, end, nblk, stride_kp, stride_ks, PAGE):
    R: gl.constexpr = cn.shape[2]
    BN: gl.constexpr = cn.shape[1]
    P: gl.constexpr = cr.shape[2]
    LN: gl.constexpr = gl.SliceLayout(1, _copy_layout(BN, R, 4))
    LR: gl.constexpr = gl.SliceLayout(1, _copy_layout(BN, P, 4))
    g_n = _load_slots(idx_row, start, end, BN, LN)
    g_r = _load_slots(idx_row, start, end, BN, LR)
    for i in range(nblk):
        b = i % 2
        n_n = _load_slots(idx_row, start + (i + 1) * BN, end, BN, LN)
        n_r = _load_slots(idx_row, start + (i + 1) * BN, end, BN, LR)
        mbarrier.wait(c_empty.index(b), ((i // 2) & 1) ^ 1)
        _gather_rows(cn.index(b), kv_ptr, g_n, stride_kp, stride_ks, 0, R, BN, PAGE, 4)
        _gather_rows(cr.index(b), kv_ptr, g_r, stride_kp, stride_ks, R, P, BN, PAGE, 4)
        cp.mbarrier_arrive(c_full.index(b), increment_count=False)
        g_n = n_n
        g_r = n_r


@gluon.jit
def _program_buffers(dtype: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, R: gl.constexpr, P: gl.constexpr,
                     C_FULL: gl.constexpr):
    """A program's shared memory and barriers, as both sparse-MLA kernels (bf16 and FP8 cache) lay
    them out: the query's latent and rope parts, the two-deep ring of cache rows, P, the rescale
    factors and final row sums; the ring's barriers (c_full counting C_FULL arrivals, c_empty both
    value halves), P's and the finish's, initialized."""
    qn = gl.allocate_shared_memory(dtype, [BH, R], gl.NVMMASharedLayout.get_default_for([BH, R], dtype))
    qr = gl.allocate_shared_memory(dtype, [BH, P], gl.NVMMASharedLayout.get_default_for([BH, P], dtype))
    cn = gl.allocate_shared_memory(dtype, [2, BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], dtype))
    cr = gl.allocate_shared_memory(dtype, [2, BN, P], gl.NVMMASharedLayout.get_default_for([BN, P], dtype))
    ps = gl.allocate_shared_memory(dtype, [BH, BN], gl.NVMMASharedLayout.get_default_for([BH, BN], dtype))
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    al = gl.allocate_shared_memory(gl.float32, [BH], vec_l)
    fin = gl.allocate_shared_memory(gl.float32, [BH], vec_l)
    c_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(c_full.index(b), count=C_FULL)
        mbarrier.init(c_empty.index(b), count=2)  # both value halves
    mbarrier.init(p_full, count=1)
    mbarrier.init(p_empty, count=1)
    mbarrier.init(fin_bar, count=1)
    return qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar


@gluon.jit
def _copy_query(qn, qr, q_ptr, idx_ptr, t, hb, sp, split_len, K, stride_qt, stride_qh, stride_it, H, R: gl.constexpr,
                P: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """The program's share of token t's slots (start, end, its blocks, the token's index row), and
    the cp.async of its head block's query into qn (latent) and qr (rope), committed, not waited."""
    start = sp * split_len
    end = gl.minimum(start + split_len, K)
    nblk = gl.cdiv(end - start, BN)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    QL: gl.constexpr = _copy_layout(BH, R, num_warps)
    hq = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, QL))
    QLR: gl.constexpr = _copy_layout(BH, P, num_warps)
    hqr = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, QLR))
    q_tok = q_ptr + t.to(gl.int64) * stride_qt
    cq = gl.arange(0, R, layout=gl.SliceLayout(0, QL))
    cp.async_copy_global_to_shared(qn, q_tok + hq[:, None] * stride_qh + cq[None, :], mask=(hq < H)[:, None])
    cqr = gl.arange(0, P, layout=gl.SliceLayout(0, QLR))
    cp.async_copy_global_to_shared(qr, q_tok + hqr[:, None] * stride_qh + R + cqr[None, :], mask=(hqr < H)[:, None])
    cp.commit_group()
    return start, end, nblk, idx_row


@gluon.jit
def _sparse_mla_hopper_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, part_ptr, lse_ptr,
    K, qk_scale, split_len,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_it, stride_ot, stride_oh,
    H: gl.constexpr, R: gl.constexpr, P: gl.constexpr, PAGE: gl.constexpr,
    BH: gl.constexpr, BN: gl.constexpr, NHB: gl.constexpr, SPLIT: gl.constexpr,
    num_warps: gl.constexpr,
):
    pid = gl.program_id(0)
    sp = gl.program_id(1)
    nsp = gl.num_programs(1)
    t = pid // NHB
    hb = pid % NHB
    qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar = _program_buffers(
        q_ptr.dtype.element_ty, BH, BN, R, P, 128)  # c_full: every producer thread's cp.async arrive
    start, end, nblk, idx_row = _copy_query(qn, qr, q_ptr, idx_ptr, t, hb, sp, split_len, K, stride_qt, stride_qh,
                                            stride_it, H, R, P, BH, BN, num_warps)
    cp.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize([
        (_ws_scores, (qn, qr, cn, cr, ps, al, fin, c_full, c_empty, p_full, p_empty, fin_bar,
                      idx_row, start, end, nblk, qk_scale, out_ptr, part_ptr, lse_ptr, t, hb, sp, nsp,
                      stride_ot, stride_oh, H, R, BH, BN, SPLIT)),
        (_ws_values_hi, (cn, ps, al, fin, c_empty, p_full, p_empty, fin_bar, nblk, out_ptr, part_ptr, t, hb, sp, nsp,
                         stride_ot, stride_oh, H)),
        (_ws_producer, (cn, cr, c_full, c_empty, kv_ptr, idx_row, start, end, nblk, stride_kp, stride_ks, PAGE)),
    ], [4, 4], [REGS_VALUES, REGS_PRODUCER])


def hopper_supports(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """The shapes this kernel is built and tested for (on the H200): a CUDA sm_90 device, bf16,
    heads in whole 64-row tiles, the GLM-5 latent row of 512 + 64 (q plus two 64-slot buffers fill
    shared memory at exactly that width)."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return kv_cache.dtype == q.dtype and hopper_shape_ok(q.dtype, q.shape[1], kv_lora_rank, q.shape[2])


def hopper_shape_ok(dtype: torch.dtype, heads: int, kv_lora_rank: int, qk_dim: int) -> bool:
    """`hopper_supports` without the device: the dtype and shapes (kernels/variants.py asks it)."""
    return dtype == torch.bfloat16 and heads % BLOCK_H == 0 and kv_lora_rank == 512 and qk_dim == 576


def sparse_mla_hopper(q, kv_cache, indices, out, part, lse, qk_scale, split_len, R, num_splits, block_n):
    """Launch over (T x head blocks, splits); `sparse_mla_triton` plans the splits, allocates the
    partial outputs ([T, H, S, R] fp32 and [T, H, S] log-sum-exps, as for its own kernel) and
    combines them."""
    T, H, _ = q.shape
    nhb = H // BLOCK_H
    _sparse_mla_hopper_kernel[(T * nhb, num_splits)](
        q, kv_cache, indices, out, part, lse, indices.shape[1], qk_scale, split_len,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), indices.stride(0),
        out.stride(0), out.stride(1),
        H=H, R=R, P=q.shape[2] - R, PAGE=kv_cache.shape[1], BH=BLOCK_H, BN=block_n, NHB=nhb, SPLIT=num_splits > 1,
        num_warps=4, maxnreg=MAXNREG,
    )

"""Triton DFlash draft attention (semantics: kernels/draft_attention.py), pages read in place.

Grid (R·kv, splits): a program takes one request's KV head, all its M query rows (G heads × B
block positions, one tile) and one contiguous share of the request's W pages. Per page it reads
the page's mask slice (page_size bytes) and skips the page when nothing in it is visible; else it
loads the page's K and V tiles straight from the pool (one contiguous page_size × hd block each,
hidden slots masked out of the load) and runs an online softmax in fp32 (base 2) with two
tensor-core products. The last split also takes the B block keys. One split writes the output;
several write normalized partial outputs and log-sum-exps that `_combine_kernel` merges.

Why: the gathered formulation copied every request's whole context of every draft layer, then
once more per layer to append the block, before SDPA read it a third time; here each visible
context byte is read once per layer. Splits keep a small batch (batch 1: kv programs) from
leaving most SMs idle."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, tl_dtype, triton_interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, k, v, vis, m_i, l_i, acc, qk_scale, P_TY: tl.constexpr, DOT_F32: tl.constexpr,
            PRECISION: tl.constexpr):
    # one tile of keys k/v [N, D] (vis [N]: which are visible) into the running (m, l, acc)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(vis[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: keep exp2 finite
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:  # interpreter: round the probabilities as the compiled kernel does, multiply in fp32
        pc = p.to(P_TY).to(tl.float32)
    else:
        pc = p.to(P_TY)
    acc = tl.dot(pc, v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _page(q, k_head, page_id_ptr, stride_pp, stride_ph, vis, dm, m_i, l_i, acc, qk_scale, P_TY: tl.constexpr,
          DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    # one context page: its K and V tiles read in place (hidden slots masked out of the loads)
    kp = k_head + tl.load(page_id_ptr).to(tl.int64) * stride_pp
    ld = vis[:, None] & dm[None, :]
    k = tl.load(kp, mask=ld, other=0.0)
    v = tl.load(kp + stride_ph, mask=ld, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return _attend(q, k, v, vis, m_i, l_i, acc, qk_scale, P_TY, DOT_F32, PRECISION)


# Counts that only bound loops, masks and offsets follow the batch and its context (and the block
# size of an eager step): not specialized, so a step never picks a variant start-up did not
# compile (kernels/variants.py). The mask and table row strides (W·page_size + B, W) lose their
# 16-byte class: the mask reads are 16 bytes a page against the K/V tiles' 2·page_size·hd.
@triton.jit(do_not_specialize=["M", "B", "W", "pages_per_split", "stride_tr", "stride_mr"])
def _draft_attn_kernel(
    q_ptr, pool_ptr, table_ptr, kb_ptr, vb_ptr, mask_ptr, out_ptr, part_ptr, lse_ptr,
    M, B, W, pages_per_split, qk_scale,
    stride_qr, stride_qh, stride_qm,
    stride_pp, stride_ph, stride_ps,
    stride_tr, stride_mr,
    stride_br, stride_bb, stride_bh,
    stride_or, stride_oh, stride_om,
    KV: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT: tl.constexpr, SKIP: tl.constexpr, P_TY: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)  # r · KV + h
    sp = tl.program_id(1)
    r = (pid // KV).to(tl.int64)
    h = pid % KV
    m = tl.arange(0, BLOCK_M)
    mm = m < M
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + m[:, None] * stride_qm + d[None, :],
                mask=mm[:, None] & dm[None, :], other=0.0)
    if DOT_F32:  # the interpreter multiplies bf16 as raw integers: widen first (exact)
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    s = tl.arange(0, BLOCK_S)
    sm = s < PAGE
    mask_row = mask_ptr + r * stride_mr
    k_head = pool_ptr + (2 * h) * stride_ph + s[:, None] * stride_ps + d[None, :]
    w0 = sp * pages_per_split
    w1 = tl.minimum(w0 + pages_per_split, W)
    for w in range(w0, w1):
        vis = (tl.load(mask_row + w * PAGE + s, mask=sm, other=0) != 0) & sm
        # SKIP: a page with nothing visible costs its mask bytes only; without, its loads are
        # masked off (no traffic) but its products run (a loop with no branch pipelines better)
        if SKIP:
            if tl.max(vis.to(tl.int32), axis=0) > 0:
                m_i, l_i, acc = _page(q, k_head, table_ptr + r * stride_tr + w, stride_pp, stride_ph, vis, dm,
                                      m_i, l_i, acc, qk_scale, P_TY, DOT_F32, PRECISION)
        else:
            m_i, l_i, acc = _page(q, k_head, table_ptr + r * stride_tr + w, stride_pp, stride_ph, vis, dm,
                                  m_i, l_i, acc, qk_scale, P_TY, DOT_F32, PRECISION)

    if sp == tl.num_programs(1) - 1:  # the block's own keys, once per request
        j = tl.arange(0, BLOCK_B)
        vis = (tl.load(mask_row + W * PAGE + j, mask=j < B, other=0) != 0) & (j < B)
        off = r * stride_br + j[:, None] * stride_bb + h * stride_bh + d[None, :]
        ld = vis[:, None] & dm[None, :]
        k = tl.load(kb_ptr + off, mask=ld, other=0.0)
        v = tl.load(vb_ptr + off, mask=ld, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _attend(q, k, v, vis, m_i, l_i, acc, qk_scale, P_TY, DOT_F32, PRECISION)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:  # partial output [R·KV, S, BLOCK_M, BLOCK_D] and base-2 log-sum-exp [R·KV, S, BLOCK_M]
        prow = pid.to(tl.int64) * tl.num_programs(1) + sp
        tl.store(part_ptr + (prow * BLOCK_M + m[:, None]) * BLOCK_D + d[None, :], o)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + prow * BLOCK_M + m, lse)
    else:
        tl.store(out_ptr + r * stride_or + h * stride_oh + m[:, None] * stride_om + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mm[:, None] & dm[None, :])


@triton.jit(do_not_specialize=["M", "NSPLIT"])  # follow the block and the split plan
def _combine_kernel(part_ptr, lse_ptr, out_ptr, M, NSPLIT, stride_or, stride_oh, stride_om,
                    KV: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    r = (pid // KV).to(tl.int64)
    h = pid % KV
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mx = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    den = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for sp in range(0, NSPLIT):  # running merge of the splits by their log-sum-exps
        prow = pid.to(tl.int64) * NSPLIT + sp
        lse = tl.load(lse_ptr + prow * BLOCK_M + m)
        mn = tl.maximum(mx, lse)
        mu = tl.where(mn == float("-inf"), 0.0, mn)
        a = tl.exp2(mx - mu)
        wgt = tl.exp2(lse - mu)
        part = tl.load(part_ptr + (prow * BLOCK_M + m[:, None]) * BLOCK_D + d[None, :])
        acc = acc * a[:, None] + part * wgt[:, None]
        den = den * a + wgt
        mx = mn
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out_ptr + r * stride_or + h * stride_oh + m[:, None] * stride_om + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & (d < HD)[None, :])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_splits(programs: int, pages: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """(splits, pages per split): by default about √(4·pages) splits of whole pages, at most four
    programs per SM (batch 64 × 8 KV heads: one split; batch 1 over 64 pages: 16 of 4 pages).
    The combine merges the splits one after another and each split walks its pages one after
    another, so their sum is least near the square root: on the H200, 64 pages of the embedded
    draft at batch 1 took 12.0 µs in 16 splits against 18.4 µs in the 64 that two programs per
    SM gave, and batch 16 17.6 µs in 8 against 23.8 µs in 4. Shapes only: a captured graph
    replays the same plan."""
    return split_plan(programs, pages, _num_sms(device), num_splits)


def split_plan(programs: int, pages: int, sms: int, num_splits: int | None = None) -> tuple[int, int]:
    """`plan_splits` on `sms` SMs."""
    if num_splits is None:
        num_splits = min(math.isqrt(4 * max(pages, 1) - 1) + 1, max(1, 4 * sms // max(programs, 1)))
    per = max(1, triton.cdiv(pages, max(1, min(num_splits, pages))))
    return max(1, triton.cdiv(pages, per)), per


def launch_constants(m: int, hd: int, ps: int, b: int, num_warps: int | None = None,
                     interp: bool = False) -> dict:
    """The tiles and warps a launch of M query rows, head dim hd, pages of ps slots and a block of
    b keys compiles for (kernels/variants.draft_attention_key states its variants from these)."""
    block_m = max(16, triton.next_power_of_2(m))
    np2 = triton.next_power_of_2
    return dict(BLOCK_M=block_m, BLOCK_D=max(16, np2(hd)), BLOCK_S=max(16, np2(ps)), BLOCK_B=max(16, np2(b)),
                num_warps=1 if interp else (num_warps or (4 if block_m <= 32 else 8)))


def draft_attention_triton(q, pool, layer, table, k_blk, v_blk, mask, num_splits=None, skip_hidden=True,
                           num_warps=None, num_stages=2, out=None) -> torch.Tensor:
    """The schedule knobs (`num_splits`, `skip_hidden`, `num_warps`, `num_stages`) change the
    speed only. `out`: [R, kv, M, hd] with a unit last stride, or None for a new tensor."""
    r, kv, m, hd = q.shape
    ps = pool.shape[3]
    w, b = table.shape[1], k_blk.shape[1]
    assert pool.dtype == q.dtype == k_blk.dtype == v_blk.dtype, (q.dtype, pool.dtype, k_blk.dtype)
    assert q.stride(-1) == 1 and pool.stride(-1) == 1 and k_blk.stride(-1) == 1 and v_blk.stride() == k_blk.stride()
    pool_l = pool.select(2, layer)  # [pages, 2·kv, ps, hd], strided
    table = table if table.stride(1) == 1 else table.contiguous()
    mask8 = mask.contiguous().view(torch.uint8)
    if out is None:
        out = torch.empty((r, kv, m, hd), dtype=q.dtype, device=q.device)
    interp = triton_interpreting()
    c = launch_constants(m, hd, ps, b, num_warps, interp)
    block_m, block_d, warps = c["BLOCK_M"], c["BLOCK_D"], c.pop("num_warps")
    splits, per = plan_splits(r * kv, w, q.device, num_splits)
    if splits > 1:
        part = torch.empty((r * kv, splits, block_m, block_d), dtype=torch.float32, device=q.device)
        lse = torch.empty((r * kv, splits, block_m), dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # never touched
    _draft_attn_kernel[(r * kv, splits)](
        q, pool_l, table, k_blk, v_blk, mask8, out, part, lse,
        m, b, w, per, hd**-0.5 * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        pool_l.stride(0), pool_l.stride(1), pool_l.stride(2),
        table.stride(0), mask8.stride(0),
        k_blk.stride(0), k_blk.stride(1), k_blk.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        KV=kv, HD=hd, PAGE=ps, **c, SPLIT=splits > 1, SKIP=skip_hidden, P_TY=tl_dtype(q.dtype), DOT_F32=interp,
        PRECISION=dot_precision(q.dtype), num_warps=warps, num_stages=num_stages,
    )
    if splits > 1:
        # the attention's warps: at 4 a 128-row block's fp32 accumulator alone took 128 registers a
        # thread and the combine spilled (tools/triton_build.py, sm_90: 255 registers, 184 B local)
        _combine_kernel[(r * kv,)](
            part, lse, out, m, splits, out.stride(0), out.stride(1), out.stride(2),
            KV=kv, HD=hd, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps,
        )
    return out

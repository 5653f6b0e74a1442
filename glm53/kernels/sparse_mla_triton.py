"""Triton sparse MLA decode/verify (absorbed form) over the paged latent cache, split + combine.

Grid (T · head blocks, splits): a program takes one query token, BLOCK_H of its heads and one
contiguous share of the token's K selected slots; it gathers the slots' latent rows
([R nope | P rope], page and token strides), runs an online softmax with two tensor-core products
per block of BLOCK_N slots (q_nope·c^T + q_pe·k_pe^T, then P·c) and writes either the output
(one split) or its normalized partial output and log-sum-exp (base 2) for `_combine_kernel`.
Slots of -1 are masked out; a token with no valid slot gets zeros (as the reference).

On Hopper the GLM-5 shapes run `sparse_mla_hopper` (Gluon, warp-specialized; 61 us against this
kernel's 98 us at 64 tokens x 64 heads) through `kernel=None`; this kernel is the
portable one, and the one CI runs under TRITON_INTERPRET=1 (Gluon has no interpreter).

Schedule (H200, 64 tokens x 2048 slots, bf16; benchmarks/kernels.py --sweep): BLOCK_N 64 slots,
BLOCK_H 64 heads on 8 warps, 3 pipeline stages (the slot indices feed the gathers' addresses, so
the pipeliner needs a third stage to prefetch the gathers), the latent row loaded as two column
halves with two accumulators (`col_halves`): 99 us at 64 heads against 144 us for 2 stages and
one 512-wide tile. Measured and dropped (slower at 64 and 128 heads): a value split (a program
pair each accumulating half of the value columns, one warpgroup each) and a lazy rescale (skip the
accumulator rescale until a row max grows by 2^8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, triton_interpreting
from glm53.kernels.launch_early import early_args, pdl_option, wait_then_release
from glm53.kernels.sparse_mla_hopper import BLOCK_H as HOPPER_BLOCK_H, hopper_supports, sparse_mla_hopper

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, part_ptr, lse_ptr,
    K, qk_scale, split_len,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_it, stride_ot, stride_oh,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NHB: tl.constexpr, SPLIT: tl.constexpr,
    HALVES: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    # HALVES: the latent row's R part is loaded as two column tiles A (low) and B (high) of
    # BLOCK_R/2, with two accumulators; the scores are the sum of three partial dots. Otherwise A
    # is the whole R part and B does not exist.
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    t = pid // NHB
    hb = pid % NHB
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    if HALVES:
        BA: tl.constexpr = BLOCK_R // 2
        b = BA + tl.arange(0, BA)
        bm = b < R
    else:
        BA: tl.constexpr = BLOCK_R
    a = tl.arange(0, BA)
    am = a < R
    p = tl.arange(0, BLOCK_P)
    pm = p < P
    q_row = q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_a = tl.load(q_row + a[None, :], mask=hm[:, None] & am[None, :], other=0.0)
    q_pe = tl.load(q_row + R + p[None, :], mask=hm[:, None] & pm[None, :], other=0.0)
    if HALVES:
        q_b = tl.load(q_row + b[None, :], mask=hm[:, None] & bm[None, :], other=0.0)
    if DOT_F32:  # the interpreter multiplies bf16 as raw uint16: widen first (exact)
        q_a = q_a.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
        if HALVES:
            q_b = q_b.to(tl.float32)

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_a = tl.zeros((BLOCK_H, BA), dtype=tl.float32)
    if HALVES:
        acc_b = tl.zeros((BLOCK_H, BA), dtype=tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, K)
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + j, mask=j < end, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        # page / offset in int32 by a constant page size (shifts for a power of two): a runtime
        # 64-bit division per row cost ~100 instructions a slot row
        page = slot // PAGE
        base = page.to(tl.int64) * stride_kp + (slot - page * PAGE) * stride_ks
        row = kv_ptr + base[:, None]
        c_a = tl.load(row + a[None, :], mask=valid[:, None] & am[None, :], other=0.0)
        kpe = tl.load(row + R + p[None, :], mask=valid[:, None] & pm[None, :], other=0.0)
        if HALVES:
            c_b = tl.load(row + b[None, :], mask=valid[:, None] & bm[None, :], other=0.0)
        if DOT_F32:
            c_a = c_a.to(tl.float32)
            kpe = kpe.to(tl.float32)
            if HALVES:
                c_b = c_b.to(tl.float32)
        s = tl.dot(q_a, tl.trans(c_a), input_precision=PRECISION)
        if HALVES:
            s = tl.dot(q_b, tl.trans(c_b), s, input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(kpe), s, input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        pr = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc_a = acc_a * alpha[:, None]
        if HALVES:
            acc_b = acc_b * alpha[:, None]
        m_i = m_new
        if DOT_F32:
            pr_c = pr.to(kv_ptr.dtype.element_ty).to(tl.float32)
        else:
            pr_c = pr.to(c_a.dtype)
        acc_a = tl.dot(pr_c, c_a, acc_a, input_precision=PRECISION)
        if HALVES:
            acc_b = tl.dot(pr_c, c_b, acc_b, input_precision=PRECISION)

    has = l_i > 0.0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    o_a = acc_a * inv[:, None]
    if HALVES:
        o_b = acc_b * inv[:, None]
    if SPLIT:
        nsp = tl.num_programs(1)
        prow = (t.to(tl.int64) * H + h) * nsp + sp  # [T, H, S] layout
        part_row = part_ptr + prow[:, None] * BLOCK_R
        tl.store(part_row + a[None, :], o_a, mask=hm[:, None] & am[None, :])
        if HALVES:
            tl.store(part_row + b[None, :], o_b, mask=hm[:, None] & bm[None, :])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + prow, lse, mask=hm)
    else:
        out_row = out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh
        tl.store(out_row + a[None, :], o_a.to(out_ptr.dtype.element_ty), mask=hm[:, None] & am[None, :])
        if HALVES:
            tl.store(out_row + b[None, :], o_b.to(out_ptr.dtype.element_ty), mask=hm[:, None] & bm[None, :])


@triton.jit
def combine_row(part_ptr, lse_ptr, row, NSPLIT, R, BLOCK_R: tl.constexpr, BLOCK_SP: tl.constexpr):
    """One (token, head) row of the output, fp32 [BLOCK_R]: its splits' normalized partials
    (part [rows, NSPLIT, BLOCK_R] fp32) weighted by their base-2 log-sum-exps (lse [rows, NSPLIT]);
    `row` = token * heads + head. The one combine both `_combine_kernel` and the W_UV product that
    takes the splits (`fp8_act._uv_fp8_kernel`) run, so the two give the same bits."""
    sidx = tl.arange(0, BLOCK_SP)
    sm = sidx < NSPLIT
    lse = tl.load(lse_ptr + row.to(tl.int64) * NSPLIT + sidx, mask=sm, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
    r = tl.arange(0, BLOCK_R)
    part = tl.load(part_ptr + (row.to(tl.int64) * NSPLIT + sidx)[:, None] * BLOCK_R + r[None, :],
                   mask=sm[:, None] & (r < R)[None, :], other=0.0)
    return tl.sum(part * w[:, None], axis=0)


@triton.jit(do_not_specialize=["NSPLIT"])  # the split count follows the token count
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, NSPLIT, stride_ot, stride_oh,
    H: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SP: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched while the split kernel drains (programmatic dependent launch)
        # the kernel after it may launch now too (the W_UV product prefetches its weight, then waits)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)  # t * H + h
    t = pid // H
    h = pid % H
    o = combine_row(part_ptr, lse_ptr, pid, NSPLIT, R, BLOCK_R, BLOCK_SP)
    r = tl.arange(0, BLOCK_R)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + r, o.to(out_ptr.dtype.element_ty), mask=r < R)


# The combine's launch shape: its tile is the same in `_uv_fp8_kernel` (the same layout, so the
# same order of the sum over splits)
COMBINE_WARPS = 4


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Each split writes its partial output, H·R fp32 a token, which the combine (or the W_UV product,
# `fp8_act.UV_SPLITS_MAX_ROWS`) reads back. A launch's splits are capped so that those partials
# stay within PARTIAL_BYTES, but never below MIN_SPLITS a token (fewer splits lengthen each
# program's chain of slot blocks). The FP8 slice's decode step on an H100 (64 heads × R 512: 128 KB
# a token's split, so 32 token-splits), one wave against a cap: 4 tokens 1,052.8 vs 1,019.0 µs
# (32 vs 8 splits; 4 splits 1,059.4), 8 tokens 1,140.9 vs 1,117.2 (16 vs 8; 4 splits 1,144.2);
# 1 and 2 tokens unchanged at 32 and 16 (957.8, 989.5-991.0); 16 tokens 1,231.1 at 8 vs 1,223.2 at 4
# (within noise); 32 tokens flat from 2 to 16 splits. Shapes with few heads a rank (GLM-5 at tp = 8:
# 8 heads, 16 KB) write little and keep the wave (not measured: left as they were).
PARTIAL_BYTES = 4 << 20
MIN_SPLITS = 8


def split_count(T: int, K: int, nhb: int, block_n: int, sms: int, row_bytes: int,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len) for T tokens x nhb head blocks over K slots on `sms` SMs: by default
    at most one wave of programs (measured on the H200 at 2 stages: 2 splits at 64 tokens x 64
    heads beat 4 or 5) and at most max(MIN_SPLITS, PARTIAL_BYTES / (T · row_bytes)) splits, where
    `row_bytes` is a token's partial output of one split (heads × R fp32); at least one block of
    slots each. A pure function of the counts (kernels/variants.py enumerates what it gives)."""
    if num_splits is None:
        cap = max(MIN_SPLITS, PARTIAL_BYTES // max(T * row_bytes, 1))
        num_splits = max(1, min(sms // (T * nhb), triton.cdiv(K, block_n), cap))
    split_len = triton.cdiv(triton.cdiv(max(K, 1), num_splits), block_n) * block_n
    return max(1, triton.cdiv(K, split_len)), split_len


def launch_inputs(q: torch.Tensor, indices: torch.Tensor, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What every sparse MLA launcher starts from: its output [T, H, R] in q's dtype, and the
    selected slots as int32 with a unit last stride on q's device."""
    out = torch.empty((*q.shape[:2], R), dtype=q.dtype, device=q.device)
    indices = indices.to(device=q.device, dtype=torch.int32)
    return out, indices if indices.stride(1) == 1 else indices.contiguous()


def default_tiles(H: int, R: int, P: int, block_h: int | None, interp: bool) -> tuple[int, int, int, int]:
    """The tl kernels' (BLOCK_R, BLOCK_P, block_h, num_warps): the latent rank and rope width as
    powers of two (the latent's halves stay >= 16 wide, tl.dot's minimum); unless given, up to 64
    heads a program; warps for that head tile, two warpgroups once the fp32 accumulator reaches
    64 x 256 (128 registers a thread on one)."""
    BLOCK_R = max(32, triton.next_power_of_2(R))
    block_h = block_h or min(64, max(16, triton.next_power_of_2(H)))
    warps = 1 if interp else (8 if block_h * BLOCK_R >= 64 * 256 else 4)
    return BLOCK_R, max(16, triton.next_power_of_2(max(P, 1))), block_h, warps


def plan_splits(q: torch.Tensor, out: torch.Tensor, K: int, nhb: int, block_n: int, num_splits: int | None,
                block_r: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """How the K selected slots are split across programs (`split_count`): (num_splits,
    split_len, part, lse). With one split, `part` and `lse` are `out` (never touched)."""
    T, H, R = out.shape  # out: [T, H, R], the latent rank
    num_splits, split_len = split_count(T, K, nhb, block_n, _num_sms(q.device), H * R * 4, num_splits)
    if num_splits == 1:
        return 1, split_len, out, out
    part = torch.empty((T, H, num_splits, block_r), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
    return num_splits, split_len, part, lse


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int, R: int,
                   block_r: int) -> None:
    """Merge the splits' partial outputs into `out` by their log-sum-exps (nothing with one split)."""
    if num_splits == 1:
        return
    interp = triton_interpreting()
    T, H = out.shape[:2]
    _combine_kernel[(T * H,)](
        part, lse, out, num_splits, out.stride(0), out.stride(1),
        H=H, R=R, BLOCK_R=block_r, BLOCK_SP=triton.next_power_of_2(num_splits), PDL=not interp,
        num_warps=COMBINE_WARPS, **pdl_option(not interp),
    )


@dataclass
class Splits:
    """A sparse MLA output whose splits are not combined yet: `out` [T, H, R] (q's dtype) is where
    they go, `part` [T, H, num_splits, block_r] fp32 and `lse` [T, H, num_splits] what they are.
    The W_UV product combines them in its own launch (`fp8_act.uv_product_fp8`); `combine` is
    the usual launch."""

    out: torch.Tensor
    part: torch.Tensor
    lse: torch.Tensor
    num_splits: int
    R: int

    @property
    def block_r(self) -> int:
        return self.part.shape[-1]

    def combine(self) -> torch.Tensor:
        combine_splits(self.part, self.lse, self.out, self.num_splits, self.R, self.block_r)
        return self.out


def finish_splits(out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor, num_splits: int, R: int, block_r: int,
                  keep: bool) -> torch.Tensor | Splits:
    """A sparse MLA kernel's result: `out`, its splits combined, or with `keep` and more than one
    split those splits left to the reader (`Splits`)."""
    if keep and num_splits > 1:
        return Splits(out, part, lse, num_splits, R)
    combine_splits(part, lse, out, num_splits, R, block_r)
    return out


def sparse_mla_triton(
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
    col_halves: bool = True,
    kernel: str | None = None,
    keep_splits: bool = False,
) -> torch.Tensor | Splits:
    """The schedule options (None: the measured defaults) only change the speed, not the result.
    `keep_splits`: leave more than one split uncombined (`Splits`, for the W_UV product to take).
    `kernel`: "hopper" (the Gluon kernel of `sparse_mla_hopper`, sm_90 only; `block_n` 32 or 64
    applies), "tl" (this module's kernel; `block_h`, `num_warps`, `num_stages` and
    `col_halves`, the latent row as two column halves with two accumulators, apply) or None: the
    Hopper kernel wherever it supports the shapes, else this one."""
    T, H, Dqk = q.shape
    num_pages, page_size, Dkv = kv_cache.shape
    R = kv_lora_rank
    P = Dqk - R
    assert Dkv == Dqk and P >= 0, f"q dim {Dqk} vs cache dim {Dkv}"
    assert q.stride(2) == 1 and kv_cache.stride(2) == 1, "the latent dim must be contiguous"
    assert kv_cache.dtype == q.dtype, f"q {q.dtype} vs kv_cache {kv_cache.dtype}"
    K = indices.shape[1]
    out, indices = launch_inputs(q, indices, R)
    if T == 0:
        return out
    interp = triton_interpreting()
    if kernel is None:
        kernel = "hopper" if not interp and hopper_supports(q, kv_cache, R) else "tl"
    assert kernel in ("hopper", "tl"), kernel
    if kernel == "hopper":
        assert hopper_supports(q, kv_cache, R), "the Hopper kernel needs sm_90, bf16, 64-head tiles and 512 + 64"
        block_h = HOPPER_BLOCK_H
        block_n = block_n or 64
        assert block_n in (32, 64), "the Hopper kernel's slot block is 32 or 64 (64 fills shared memory)"
    BLOCK_R, BLOCK_P, block_h, warps = default_tiles(H, R, P, block_h, interp)
    num_warps = num_warps or warps
    if block_n is None:
        block_n = 16 if interp else 64
    if num_stages is None:
        num_stages = 1 if interp else 3
    nhb = triton.cdiv(H, block_h)
    num_splits, split_len, part, lse = plan_splits(q, out, K, nhb, block_n, num_splits, BLOCK_R)
    qk_scale = sm_scale * LOG2E
    if kernel == "hopper":
        sparse_mla_hopper(q, kv_cache, indices, out, part, lse, qk_scale, split_len, R, num_splits, block_n)
    else:
        _sparse_mla_kernel[(T * nhb, num_splits)](
            q, kv_cache, indices, out, part, lse,
            K, qk_scale, split_len,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), indices.stride(0),
            out.stride(0), out.stride(1),
            H=H, R=R, P=P, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P, PAGE=page_size, BLOCK_H=block_h, BLOCK_N=block_n,
            NHB=nhb, SPLIT=num_splits > 1, HALVES=col_halves, DOT_F32=interp,
            PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages, **early_args(),
        )
    return finish_splits(out, part, lse, num_splits, R, BLOCK_R, keep_splits)

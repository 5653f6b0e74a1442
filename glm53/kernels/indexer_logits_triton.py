"""Triton DSA indexer logits over a paged key cache (bf16, or the FP8 132 B/token layout).

One program per (query token, block of BLOCK_S context positions): gather the block's keys
through the token's page-table row (page and token strides, so a layer's view of a page-major
pool works as is), one tensor-core product `keys [S, D] · q^T [D, H]`, ReLU, the head-weighted
sum, the per-token FP8 scale, -inf past the token's length. Blocks wholly past the length only
write -inf (their loads are masked off, so they cost no key bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import dot_precision, triton_interpreting
from glm53.kernels.launch_early import early_args, wait_then_release
from glm53.kernels.rope_triton import rotate_pair


# The widths vary with every batch (the context, the page-table width): not specialized, so one
# compiled variant serves every batch (kernels/variants.py).
@triton.jit(do_not_specialize=["max_len", "stride_ptt", "stride_ot"])
def _indexer_logits_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, pt_ptr, len_ptr, out_ptr, cos_ptr, sin_ptr,
    max_len,
    stride_qt, stride_qh, stride_wt, stride_kp, stride_ks, stride_sp,
    stride_ptt, stride_ot, stride_c,
    H: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr, QFP8: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr = 0, INTERLEAVE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # HALF > 0: q's first 2·HALF columns are rotated here, as `rope_triton` rotates them (pair j's
    # o1 to column j, its o2 to HALF + j, each rounded by `rotate_pair`), where a launch before
    # did it: a column's partner is loaded again, so no value moves between threads
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    t = tl.program_id(0)
    sb = tl.program_id(1)
    n = tl.load(len_ptr + t)
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    live = s < n
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    page = tl.load(pt_ptr + t.to(tl.int64) * stride_ptt + s // PAGE_SIZE, mask=live, other=0).to(tl.int64)
    koff = page * stride_kp + (s % PAGE_SIZE) * stride_ks
    k = tl.load(k_ptr + koff[:, None] + d[None, :], mask=live[:, None], other=0.0)  # [S, D]
    q_rows = q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=(h < H)[:, None], other=0.0)  # [BH, D]
    if HALF > 0:
        dt = q.dtype
        rot = d < 2 * HALF
        i = tl.where(rot, d % HALF, 0)
        first = d < HALF
        if INTERLEAVE:  # pair i is (2i, 2i + 1)
            a_col, b_col = 2 * i, 2 * i + 1
        else:  # halves
            a_col, b_col = i, HALF + i
        qm = (h < H)[:, None] & rot[None, :]
        xa = tl.load(q_rows + a_col[None, :], mask=qm, other=0.0).to(tl.float32)
        xb = tl.load(q_rows + b_col[None, :], mask=qm, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t.to(tl.int64) * stride_c + i, mask=rot, other=0.0).to(dt).to(tl.float32)[None, :]
        sn = tl.load(sin_ptr + t.to(tl.int64) * stride_c + i, mask=rot, other=0.0).to(dt).to(tl.float32)[None, :]
        f = first[None, :]
        o = rotate_pair(tl.where(f, xa, xb), tl.where(f, xb, xa), c, tl.where(f, sn, -sn), dt)
        q = tl.where(rot[None, :], o, q)
    if FP8:
        if not QFP8:
            # e4m3 -> fp16 is one native conversion on sm_90 (bf16 would go through fp32)
            k = k.to(tl.float16)
            q = q.to(tl.float16)
    if DOT_F32:  # the interpreter multiplies bf16 as raw uint16: widen first (exact)
        k = k.to(tl.float32)
        q = q.to(tl.float32)
    scores = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [S, BH] fp32
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + h, mask=h < H, other=0.0).to(tl.float32)
    logit = tl.sum(tl.maximum(scores, 0.0) * w[None, :], axis=1)
    if FP8:
        scale = tl.load(ks_ptr + page * stride_sp + (s % PAGE_SIZE), mask=live, other=0.0)
        logit = logit * scale
    logit = tl.where(live, logit, float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + s, logit, mask=s < max_len)


def indexer_logits_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    k_scales: torch.Tensor | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
) -> torch.Tensor:
    """k_cache [num_pages, page_size, D] bf16/fp16, or fp8 e4m3 with k_scales [num_pages, page_size]
    fp32 (see index_cache_fp8.split_view). q [T, H, D] bf16/fp16, or fp8 e4m3 with its scales
    folded into `weights` (then the product runs in fp8). With fp8 keys and a bf16 q, the product
    runs in fp16 (q must stay within fp16 range, |q| < 65504: true of RoPE'd indexer queries).
    `rope` (cos, sin [T, R/2] fp32, interleave), bf16/fp16 q only: q's first R columns are read
    rotated (`rope.apply_rope`'s values) rather than rotated by a launch before."""
    T, H, D = q.shape
    num_pages, page_size, Dk = k_cache.shape
    assert Dk == D and D == triton.next_power_of_2(D), "index_head_dim must be a power of two"
    assert k_cache.stride(2) == 1 and q.stride(2) == 1, "the head dim must be contiguous"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    qfp8 = q.dtype == torch.float8_e4m3fn
    assert fp8 == (k_scales is not None), "an fp8 key cache needs its scales (and only it)"
    assert fp8 or not qfp8, "fp8 queries need the fp8 key cache"
    if not fp8:
        assert k_cache.dtype == q.dtype, f"q {q.dtype} vs k_cache {k_cache.dtype}"
    out = torch.empty((T, max_len), dtype=torch.float32, device=q.device)
    if T == 0 or max_len == 0:
        return out
    lengths = lengths.to(device=q.device, dtype=torch.int32).contiguous()
    page_table = page_table.to(device=q.device, dtype=torch.int32)
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    interp = triton_interpreting()
    if block_s is None:
        block_s = 64 if interp else 128
    if num_warps is None:
        num_warps = 1 if interp else 4
    BLOCK_H = max(16, triton.next_power_of_2(H))
    ks = k_scales if fp8 else k_cache
    stride_sp = k_scales.stride(0) if fp8 else 0
    if fp8:
        assert k_scales.stride(1) == 1
    cos, sin, interleave = rope if rope is not None else (out, out, False)
    half = cos.shape[1] if rope is not None else 0
    if rope is not None:
        assert not qfp8 and cos.shape == sin.shape == (T, half) and cos.stride() == sin.stride(), cos.shape
        assert cos.stride(1) == 1 and 2 * half <= D and half & (half - 1) == 0, (cos.stride(), half, D)
    grid = (T, triton.cdiv(max_len, block_s))
    _indexer_logits_kernel[grid](
        q, weights, k_cache, ks, page_table, lengths, out, cos, sin, max_len,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1), stride_sp,
        page_table.stride(0), out.stride(0), cos.stride(0),
        H=H, D=D, PAGE_SIZE=page_size, BLOCK_H=BLOCK_H, BLOCK_S=block_s, FP8=fp8, QFP8=qfp8,
        DOT_F32=interp and not qfp8, PRECISION=dot_precision(q.dtype), HALF=half, INTERLEAVE=interleave,
        num_warps=num_warps, **early_args(),
    )
    return out

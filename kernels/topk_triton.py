"""Triton DSA top-k: exact radix select, rows split over several programs.

Contract: `kernels/topk.py` (the set of the k best positions of each row's valid prefix, ties by
lowest position, -1 padding when length <= k). Three launches (plus one memset), all with grids
fixed by the shapes (lengths are read on the device, so the whole op is CUDA-graph safe):

1. `_hist_kernel`, grid (B, C): each program takes one chunk of a row and stores a 256-bin
   histogram of a coarse key (the top 8 bits of the order-preserving fp16 key: quarter octaves)
   for its chunk. 256 bins because `tl.histogram` costs O(bins / 32) per element (warp ballots
   per bin).
2. `_select_kernel`, grid (B, C): every program sums the row's chunk histograms, finds the
   threshold bin t1 (the coarse bin holding the k-th best score), writes the positions of its
   chunk's scores above t1 straight to the output (its slots start after the earlier chunks'
   counts above t1: deterministic, no atomics) and copies the exact fp32 keys of bin t1,
   in position order, to its chunk's candidate segment (up to CAP of them).
3. `_finish_kernel`, grid (B): resolves the threshold bin exactly: four 8-bit histogram rounds on
   the exact 32-bit key, then ties in position order. Fast path: all candidates of the row in
   registers (one 2-D load of the segments, chunk-major = position order). When some chunk's
   bin overflowed its segment (heavy ties, few distinct values), the same rounds stream over the
   row itself: slower, equally exact.

The coarse key is a monotone function of the score, so coarse bins order like the scores.
Exact keys: fp32 bits b -> b ^ ((b >> 31) & 0x7fffffff) orders like the floats as signed int32
(stored with bit 31 flipped, so byte digits compare unsigned); -0.0 is folded onto +0.0 and
every NaN onto the largest key (torch's descending sort puts NaN first, equal NaNs by position).
Positions past a row's length get coarse bin 0; valid scores land in bins >= 3 (-inf's), so bin 0
is never the threshold of a row with length > k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting

NB1 = 256  # first round: the top 8 bits of an fp16 rendering of the score (quarter octaves)
NB2 = 256  # refinement: four rounds of 8 bits of the exact fp32 key
BLOCK = 2048  # elements per step of the streaming kernels (H200 sweep: 2048 x 8 warps)
CAND_TOTAL = 4096  # candidates one row may hold on the fast path (H200 sweep: 4096 < 8192)
MAX_CHUNKS = 32


@triton.jit
def _load_scores(x_ptr, offs, valid):
    return tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _ukey(x, valid):
    """Exact key: int32 whose unsigned order (bit 31 flipped back) is the float order."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 == +0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order
    key = tl.where(x != x, 0x7FFFFFFF, key)  # NaN sorts first, like torch
    key = tl.where(valid, key, -2147483648)
    return key ^ -2147483648  # unsigned order in the bit pattern


@triton.jit
def _coarse_bin(x, valid):
    """0..255, monotone in x: the top 8 bits of the ordered fp16 key. Invalid -> 0; valid >= 3."""
    b = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    b = tl.where(b == -32768, 0, b)  # -0.0
    key = b ^ ((b >> 15) & 0x7FFF)
    key = tl.where(x != x, 32767, key)
    return tl.where(valid, (key >> 8) + 128, 0)


@triton.jit
def _threshold(hist, need, NB: tl.constexpr):
    """Largest bin t with (#keys in bins >= t) >= need, and the count of keys in bins > t."""
    b = tl.arange(0, NB)
    total = tl.sum(hist, axis=0)
    suffix = total - tl.cumsum(hist, axis=0) + hist  # keys in bins >= b
    t = tl.max(tl.where(suffix >= need, b, -1), axis=0)
    above = tl.sum(tl.where(b > t, hist, 0), axis=0)
    return t, above


@triton.jit
def _to_out(pos, row_pt_ptr, stride_ptp, PAGE_SIZE, PAGED: tl.constexpr):
    if PAGED:
        page = tl.load(row_pt_ptr + (pos // PAGE_SIZE) * stride_ptp)
        return (page * PAGE_SIZE + pos % PAGE_SIZE).to(tl.int32)
    else:
        return pos.to(tl.int32)


@triton.jit
def _hist_kernel(
    x_ptr, len_ptr, hist_ptr, L, stride_xb, CHUNK, C,
    K: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.minimum(tl.load(len_ptr + b), L)
    h = tl.zeros((NB,), dtype=tl.int32)
    if n > K:
        start = c * CHUNK
        x_row = x_ptr + b.to(tl.int64) * stride_xb
        for s in range(start, start + CHUNK, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            valid = offs < n
            h += tl.histogram(_coarse_bin(_load_scores(x_row, offs, valid), valid), NB)
    bins = tl.arange(0, NB)
    tl.store(hist_ptr + (b * C + c) * NB + bins, tl.where(bins > 0, h, 0))


@triton.jit
def _row_threshold(hist_ptr, b, C, K: tl.constexpr, NB: tl.constexpr, CB: tl.constexpr):
    """From the row's per-chunk histograms: threshold bin t1, keys above it, and per-chunk
    counts above it ([CB], for the chunks' output offsets)."""
    cc = tl.arange(0, CB)
    bins = tl.arange(0, NB)
    hc = tl.load(hist_ptr + (b * C + cc[:, None]) * NB + bins[None, :], mask=(cc < C)[:, None], other=0)
    t1, above1 = _threshold(tl.sum(hc, axis=0), K, NB)
    above_c = tl.sum(tl.where(bins[None, :] > t1, hc, 0), axis=1)
    return t1, above1, above_c


@triton.jit
def _select_kernel(
    x_ptr, len_ptr, hist_ptr, out_ptr, cand_ptr, ncand_ptr, pt_ptr,
    L, stride_xb, stride_ob, stride_ptb, stride_ptp, PAGE_SIZE, CHUNK, C,
    K: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    CB: tl.constexpr, PAGED: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.minimum(tl.load(len_ptr + b), L)
    if n > K:
        t1, _above1, above_c = _row_threshold(hist_ptr, b, C, K, NB, CB)
        # this chunk's output slots start after the earlier chunks' keys above t1
        written = tl.sum(tl.where(tl.arange(0, CB) < c, above_c, 0), axis=0)
        x_row = x_ptr + b.to(tl.int64) * stride_xb
        out_row = out_ptr + b.to(tl.int64) * stride_ob
        pt_row = pt_ptr + b.to(tl.int64) * stride_ptb
        seg = cand_ptr + (b * C + c).to(tl.int64) * CAP * 2
        ncand = 0
        start = c * CHUNK
        for s in range(start, start + CHUNK, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            valid = offs < n
            x = _load_scores(x_row, offs, valid)
            bin1 = _coarse_bin(x, valid)
            above = bin1 > t1
            n_above = tl.sum(above.to(tl.int32), axis=0)
            if n_above > 0:
                slot = written + tl.cumsum(above.to(tl.int32), axis=0) - 1
                tl.store(out_row + slot, _to_out(offs, pt_row, stride_ptp, PAGE_SIZE, PAGED), mask=above)
                written += n_above
            eq = bin1 == t1
            n_eq = tl.sum(eq.to(tl.int32), axis=0)
            if n_eq > 0:
                r = ncand + tl.cumsum(eq.to(tl.int32), axis=0) - 1
                m = eq & (r < CAP)
                tl.store(seg + r * 2, _ukey(x, valid), mask=m)
                tl.store(seg + r * 2 + 1, offs, mask=m)
                ncand += n_eq
        tl.store(ncand_ptr + b * C + c, ncand)


@triton.jit
def _finish_kernel(
    x_ptr, len_ptr, hist_ptr, out_ptr, cand_ptr, ncand_ptr, pt_ptr,
    L, stride_xb, stride_ob, stride_ptb, stride_ptp, PAGE_SIZE, C,
    K: tl.constexpr, KP2: tl.constexpr, NB: tl.constexpr, NB2: tl.constexpr,
    BLOCK: tl.constexpr, CAP: tl.constexpr, CB: tl.constexpr, PAGED: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.maximum(tl.minimum(tl.load(len_ptr + b), L), 0)
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    pt_row = pt_ptr + b.to(tl.int64) * stride_ptb
    if n <= K:
        # Every valid position is selected; -1 pads the rest.
        for s in range(0, K, KP2):
            j = s + tl.arange(0, KP2)
            sel = j < n
            v = _to_out(tl.where(sel, j, 0), pt_row, stride_ptp, PAGE_SIZE, PAGED)
            tl.store(out_row + j, tl.where(sel, v, -1), mask=j < K)
    else:
        t1, above1, _above_c = _row_threshold(hist_ptr, b, C, K, NB, CB)
        need = K - above1  # how many keys of coarse bin t1 are selected (>= 1)
        cc = tl.arange(0, CB)
        nc = tl.load(ncand_ptr + b * C + cc, mask=cc < C, other=0)
        bins2 = tl.arange(0, NB2)
        if tl.max(nc, axis=0) <= CAP:
            # Fast path: the whole coarse bin in registers, in position order (chunk-major).
            seg = cand_ptr + (b * C).to(tl.int64) * CAP * 2
            off = tl.arange(0, CAP)
            ok2 = off[None, :] < nc[:, None]
            ptrs = seg + (cc[:, None] * CAP + off[None, :]) * 2
            key = tl.reshape(tl.load(ptrs, mask=ok2, other=0), (CB * CAP,))
            pos = tl.reshape(tl.load(ptrs + 1, mask=ok2, other=0), (CB * CAP,))
            inr = tl.reshape(ok2, (CB * CAP,))
            gt = tl.zeros((CB * CAP,), dtype=tl.int1)
            for rnd in tl.static_range(4):
                digit = (key >> (24 - 8 * rnd)) & 255
                d = tl.where(inr, digit, 0)
                h = tl.histogram(d, NB2) - tl.where(bins2 == 0, tl.sum((~inr).to(tl.int32), axis=0), 0)
                t, above = _threshold(h, need, NB2)
                gt = gt | (inr & (digit > t))
                inr = inr & (digit == t)
                need -= above
            tie_rank = tl.cumsum(inr.to(tl.int32), axis=0) - 1
            sel = gt | (inr & (tie_rank < need))
            slot = above1 + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(out_row + slot, _to_out(tl.where(sel, pos, 0), pt_row, stride_ptp, PAGE_SIZE, PAGED), mask=sel)
        else:
            # Exact fallback over the row itself (one program; a streaming pass per round).
            x_row = x_ptr + b.to(tl.int64) * stride_xb
            pmask = 0
            pval = 0
            for rnd in tl.static_range(4):
                h = tl.zeros((NB2,), dtype=tl.int32)
                for s in range(0, n, BLOCK):
                    offs = s + tl.arange(0, BLOCK)
                    valid = offs < n
                    x = _load_scores(x_row, offs, valid)
                    key = _ukey(x, valid)
                    inr = (_coarse_bin(x, valid) == t1) & ((key & pmask) == pval)
                    d = tl.where(inr, (key >> (24 - 8 * rnd)) & 255, 0)
                    h += tl.histogram(d, NB2)
                    h -= tl.where(bins2 == 0, tl.sum((~inr).to(tl.int32), axis=0), 0)
                t, above = _threshold(h, need, NB2)
                need -= above
                pval = pval | (t << (24 - 8 * rnd))  # int32, wraps like the keys
                if rnd == 0:
                    pmask = -16777216  # 0xff000000
                elif rnd == 1:
                    pmask = -65536
                elif rnd == 2:
                    pmask = -256
                else:
                    pmask = -1
            ties = 0
            written = above1
            for s in range(0, n, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                valid = offs < n
                x = _load_scores(x_row, offs, valid)
                key = _ukey(x, valid)
                inb = _coarse_bin(x, valid) == t1
                # unsigned compare of the exact keys: flip bit 31 back to compare as signed
                gt = inb & ((key ^ -2147483648) > (pval ^ -2147483648))
                tie = inb & (key == pval)
                tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
                sel = gt | (tie & (tie_rank < need))
                slot = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(out_row + slot, _to_out(tl.where(sel, offs, 0), pt_row, stride_ptp, PAGE_SIZE, PAGED), mask=sel)
                ties += tl.sum(tie.to(tl.int32), axis=0)
                written += tl.sum(sel.to(tl.int32), axis=0)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _chunks(B: int, L: int, device: torch.device, block: int = BLOCK) -> tuple[int, int]:
    """(C, CHUNK): split each row so that B*C programs cover the machine about twice."""
    blocks = triton.cdiv(max(L, 1), block)
    c = max(1, min(blocks, triton.next_power_of_2(triton.cdiv(2 * _num_sms(device), max(B, 1)))))
    # at most MAX_CHUNKS per row, so each chunk's candidate segment keeps >= CAND_TOTAL / 32 = 128
    # slots (~35 per 2K-element chunk are used on Gaussian scores; overflow means the slow path)
    c = min(c, MAX_CHUNKS)
    chunk = triton.cdiv(blocks, c) * block
    return triton.cdiv(max(L, 1), chunk), chunk


def topk_triton(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    page_table: torch.Tensor | None = None,
    page_size: int = 1,
    cand_total: int = CAND_TOTAL,
    block: int = BLOCK,
    num_warps: int | None = None,
) -> torch.Tensor:
    """[B, k] int32 positions (or physical slots with `page_table`), -1 padded. `cand_total`
    bounds the fast path's candidates per row (tests shrink it to exercise the fallback)."""
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    B, L = logits.shape
    dev = logits.device
    out = torch.empty((B, k), dtype=torch.int32, device=dev)
    if B == 0 or k == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lengths = lengths.to(device=dev, dtype=torch.int32).contiguous()
    C, chunk = _chunks(B, L, dev, block)
    CB = triton.next_power_of_2(C)
    cap = max(16, cand_total // CB)
    hist = torch.empty((B, C, NB1), dtype=torch.int32, device=dev)  # per-chunk histograms
    cand = torch.empty((B, C, cap, 2), dtype=torch.int32, device=dev)
    ncand = torch.empty((B, C), dtype=torch.int32, device=dev)
    paged = page_table is not None
    if paged:
        pt = page_table.to(device=dev, dtype=torch.int32)
        spb, spp = pt.stride(0), pt.stride(1)
    else:
        pt, spb, spp = lengths, 0, 0  # never read
    warps = num_warps or (8 if not triton_interpreting() else 1)
    _hist_kernel[(B, C)](logits, lengths, hist, L, logits.stride(0), chunk, C,
                         K=k, NB=NB1, BLOCK=block, num_warps=warps)
    _select_kernel[(B, C)](logits, lengths, hist, out, cand, ncand, pt,
                           L, logits.stride(0), out.stride(0), spb, spp, page_size, chunk, C,
                           K=k, NB=NB1, BLOCK=block, CAP=cap, CB=CB, PAGED=paged, num_warps=warps)
    _finish_kernel[(B,)](logits, lengths, hist, out, cand, ncand, pt,
                         L, logits.stride(0), out.stride(0), spb, spp, page_size, C,
                         K=k, KP2=min(triton.next_power_of_2(k), 4096), NB=NB1, NB2=NB2,
                         BLOCK=block, CAP=cap, CB=CB, PAGED=paged, num_warps=warps)
    return out

"""Triton DSA top-k: sample-bracketed exact select, one streaming pass over the logits.

Contract: `kernels/topk.py` (the set of the k best positions of each row's valid prefix, ties by
lowest position, -1 padding when length <= k). Three launches with grids fixed by the shapes
(lengths are read on the device, so the op is CUDA-graph safe):

1. `_bracket_kernel`, grid (B): a *bracket* [lo, hi] per row from a fixed sample of the row
   (S scores in groups of G, evenly spaced, S = `row_sample`: SHORT_SAMPLE for rows up to
   SHORT_SAMPLE_MAX_WIDTH, SAMPLE past it; the whole row when it is no longer than S, then in a
   tile of the row width's power of two):
   the 16-bit keys at the sample ranks k·S/n − 4σ and + 5.5σ (4-bit radix rounds on the sample).
2. `_scan_kernel`, grid (B, C): each program streams one chunk of its row once: scores with
   key16 > hi are surely selected and go to the chunk's "above" segment; scores with
   lo <= key16 <= hi are candidates and go, with their fp32 bits, to the chunk's candidate
   segment; both in position order, per chunk (deterministic). Each program then adds its
   candidates to the row's histogram of NBIN bins over the bracket (`_cand_bin`, atomics).
3. `_finish_kernel`, grid (B, 2) (or (B, 1) past one wave): checks the bracket against the true
   counts (above <= k <= above + candidates, and the candidates fit); then one program copies the
   above segments to the output in chunk order while the other picks the k - above best
   candidates exactly, writing positions or, fused, physical slots. The scan's histogram names
   the bin of the k-th score: candidates in higher bins are selected, those in it (a dozen or so)
   are ranked pairwise (key, then lowest position). Should that bin hold more than SELECT_TILE,
   radix rounds of RBITS bits on the keys' offsets from the smallest of them (first digit aligned
   to the top bit of their range) narrow it first. Everything this path reads is loaded at once:
   one memory latency, not a chain. When the bracket missed high (more than k scores above it)
   the k best are among the kept "above" scores: their scores are read back and selected exactly.
   When it missed low, or the candidates overflow (heavy ties, adversarial rows), it selects
   exactly by streaming over the row itself: slower, equally exact. The bracket's lower margin is
   the wider one for that reason.

With programmatic dependent launch (`pdl`, on by default for CUDA) each kernel is launched while its
predecessor runs: the scan loads its first block(s) and the finish writes its short rows before
they wait (griddepcontrol.wait) for the predecessor's results; every program waits once, so each
kernel's end implies its predecessors' ends (the workspace is safe to reuse by the next call).

Why this shape: Triton has no shared-memory atomics and `tl.histogram` costs O(bins/32)
instructions per element, so histogramming every score (the CUDA kernels' first pass) is ALU-bound
far above one read of the row. Here the full row only sees a load, a key, two compares and a
prefix sum; histograms run on the 4096-score sample (ballots) and on the few thousand candidates
(global atomics, a few per program).

Keys: fp32 bits b -> b ^ ((b >> 31) & 0x7fffffff) orders like the floats as signed int32 (stored
with bit 31 flipped, so unsigned digits compare in order); -0.0 is folded onto +0.0 and every NaN
onto the largest key (torch's descending sort puts NaN first, equal NaNs by position). key16 is
the top 16 bits (sign, exponent, 7 mantissa bits): monotone in the score and range-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting
from glm53.kernels.launch_early import pdl_option

SAMPLE = 4096  # sampled scores per row for the bracket (rows past SHORT_SAMPLE_MAX_WIDTH)
# Up to this width a smaller sample: the bracket's radix rounds cost per sampled score, and the
# wider bracket it gives adds fewer candidates than that saves. H100, k = 2,048, one top-k alone
# (graphs of 8 calls, 1 and 8 rows; benchmarks/history/2026-12-06.md): 2,048 beats 4,096 at every
# width measured from 2,500 to 65,536 (4,224 wide: 11.4 vs 13.7 µs; 16,384: 11.8 vs 14.8; 65,536:
# 14.4 vs 16.8) and loses past it (98,304: 22.7 vs 17.8); 1,024 wins narrow bands by under 1 µs
# and loses others by up to 7.
SHORT_SAMPLE = 2048
SHORT_SAMPLE_MAX_WIDTH = 65536
MIN_SAMPLE = 256  # the least sample tile (`row_sample`)
GROUP = 8  # contiguous scores per sample group (one 32-byte sector)
MARGIN = 4.0  # bracket half-width above the target, in binomial standard deviations of the sample rank
LO_EXTRA = 1.5  # ... and this many more below it (a miss below costs the streaming fallback)
BLOCK = 2048  # scores per step of the streaming pass
SCAN_PREFETCH = 1  # blocks in flight per scan program (2 measured no better on the H200: 30.3-31.4 us at 64x128K)
MAX_CHUNKS = 32  # programs per row in the streaming pass
RBITS = 4  # radix digit of the exact rounds: 16-bin histograms (cheap per element)
LOGB = 8  # the scan's histogram of each row's candidates has 2^LOGB bins over the bracket
NBIN = 1 << LOGB
SELECT_TILE = 64  # the finish ranks this many keys of the k-th score's bin pairwise (rounds narrow larger bins)
FALLBACK_BITS = 4  # the streaming fallback's digit (16-bin histograms cost ~8x less than 256)
# Short rows may take one launch instead (`_rank_kernel`): each program ranks RANK_TILE positions
# of a row against the whole row, RANK_BLOCK scores a step (RANK_PREFETCH steps' loads in flight),
# and writes each one ranked under k to its rank's slot. The work is B·L² compares spread over the
# SMs and no program waits on another, where the three launches are a chain of latencies. H100,
# k = 2,048, alone (benchmarks/topk_rank.py, 2026-12-07): one row of 4,224 6.1 µs against 11.4 for
# the three launches, 2,112 wide 4.3 against 12.5, two rows of 4,224 9.6 against 11.8; but one row
# of 8,256 20.6 against 11.6 and four of 4,224 16.7 against 12.3. Hence at most RANK_MAX_ROWS rows
# and RANK_MAX_PAIRS compares (one row up to ~5,800 wide, two up to 4,096). RANK_MAX_WIDTH, above
# what the compares allow, bounds nothing today: it is the switch (0: the three launches always).
RANK_MAX_WIDTH = 8192
RANK_MAX_ROWS = 2
RANK_MAX_PAIRS = 1 << 25
RANK_TILE = 32
RANK_BLOCK = 256
RANK_WARPS = 8
RANK_PREFETCH = 2


@triton.jit
def _ukey(x, valid):
    """Exact key: int32 whose unsigned order (bit 31 flipped back) is the float order; invalid -> 0."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 == +0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order
    key = tl.where(x != x, 0x7FFFFFFF, key)  # NaN sorts first, like torch
    key = tl.where(valid, key, -2147483648)
    return key ^ -2147483648  # unsigned order in the bit pattern


@triton.jit
def _threshold(hist, need, NB: tl.constexpr):
    """Largest bin t with (#keys in bins >= t) >= need; the counts of keys in bins > t and in t.
    Callers keep need <= the total and counts below 2^27."""
    b = tl.arange(0, NB)
    if NB <= 32:
        # the bins fit one warp: each reduction is one instruction (redux), no block sync
        suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys in bins >= b
        t = tl.max(tl.where(suffix >= need, b, -1), axis=0)
        above = tl.sum(tl.where(b > t, hist, 0), axis=0)
        at = tl.sum(tl.where(b == t, hist, 0), axis=0)
        return t, above, at
    else:
        # each block-wide reduction is a sync round: a suffix sum, then one max over (bin, above,
        # at) packed in an int64
        suffix = tl.cumsum(hist, axis=0, reverse=True)
        packed = (b.to(tl.int64) << 54) | ((suffix - hist).to(tl.int64) << 27) | hist
        best = tl.max(tl.where(suffix >= need, packed, -1), axis=0)
        return (best >> 54).to(tl.int32), ((best >> 27) & 0x7FFFFFF).to(tl.int32), (best & 0x7FFFFFF).to(tl.int32)


@triton.jit
def _bracket(x_row, n, K: tl.constexpr, SAMPLE: tl.constexpr, G: tl.constexpr, margin, margin_lo,
             RB: tl.constexpr):
    """(hi, lo) 16-bit keys: with high probability #(key16 > hi) <= K <= #(key16 >= lo) over the
    row, with few scores between. Exact (hi == lo == the K-th key16) when n <= SAMPLE. Both are
    sample order statistics, found by the same radix rounds: one histogram per round serves both."""
    i = tl.arange(0, SAMPLE)
    exact = n <= SAMPLE
    NG: tl.constexpr = SAMPLE // G
    # group g starts at g * (n - G) / (NG - 1): the first and the last G scores are both sampled
    # (a row whose scores trend with position keeps its best ones at one end)
    gstart = ((i // G).to(tl.int64) * (n - G) // (NG - 1)).to(tl.int32)
    offs = tl.where(exact, i, gstart + i % G)
    valid = offs < n
    k16 = (_ukey(tl.load(x_row + offs, mask=valid, other=0.0).to(tl.float32), valid) >> 16) & 0xFFFF
    s = tl.minimum(n, SAMPLE)
    # the sample rank of the row's K-th score. A whole row's is K itself, not K * n / n: Triton's
    # fp32 `/` is the approximate division on the GPU, and 64 * 1017 / 1017 = 63.99999 put lo a
    # rank above hi, sending about half of such rows to the streaming fallback (4x the time)
    target = tl.where(exact, K * 1.0, K * s.to(tl.float32) / n.to(tl.float32))
    # a miss above the bracket is cheap (the finish re-selects from the kept scores), one below
    # it takes the streaming fallback: the lower margin is the wider one
    sd = tl.sqrt(target)
    d_hi = tl.where(exact, 0.0, margin * sd + 4.0)
    d_lo = tl.where(exact, 0.0, margin_lo * sd + 4.0)
    need_hi = tl.maximum(tl.math.ceil(target - d_hi), 0.0).to(tl.int32)
    need_lo = tl.minimum(tl.math.floor(target + d_lo), s.to(tl.float32)).to(tl.int32)
    # need_hi < 1: nothing is surely above (hi = 65535); need_lo = s: every score <= hi is a
    # candidate (lo = 0). The rounds run regardless, on ranks clamped into range.
    nh = tl.maximum(need_hi, 1)
    nl = need_lo
    NB: tl.constexpr = 1 << RB
    hi = 0
    lo = 0
    inr_h = valid
    inr_l = valid
    hb = tl.arange(0, 2 * NB)
    for rnd in tl.static_range(16 // RB):
        shift = 16 - RB * (rnd + 1)
        d = (k16 >> shift) & (NB - 1)
        # hi's and lo's in-range sets are equal while their prefixes are, disjoint after: one
        # histogram of 2 * NB bins counts both (lo's own keys in the upper half), one
        # shared-memory merge and block sync per round instead of two
        h = tl.histogram(d + tl.where(inr_l & ~inr_h, NB, 0), 2 * NB, mask=inr_h | inr_l)
        split = hi != lo  # (the prefixes so far)
        th, ah, _ = _threshold(tl.where(hb < NB, h, 0), nh, 2 * NB)
        tl_, al, _ = _threshold(tl.where((hb >= NB) == split, h, 0), nl, 2 * NB)
        tl_ = tl.where(split, tl_ - NB, tl.minimum(tl_, NB - 1))  # (need <= 0: the top bin of its half)
        nh -= ah
        nl -= al
        inr_h = inr_h & (d == th)
        inr_l = inr_l & (d == tl_)
        hi = hi | (th << shift)
        lo = lo | (tl_ << shift)
    hi = tl.where(need_hi >= 1, hi, 65535)
    lo = tl.where(need_lo < s, lo, 0)
    return hi, lo


@triton.jit
def _bracket_kernel(
    x_ptr, len_ptr, br_ptr, hist_ptr, L, stride_xb, margin, margin_lo,
    K: tl.constexpr, SAMPLE: tl.constexpr, G: tl.constexpr, RB: tl.constexpr, LOGB: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    if PDL:
        # launched early: the previous kernel may still write the logits or lengths, or read br
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.maximum(tl.minimum(tl.load(len_ptr + b), L), 0)
    if n > K:
        NBIN: tl.constexpr = 1 << LOGB
        tl.store(hist_ptr + b * NBIN + tl.arange(0, NBIN), 0)  # the scan adds its candidates to it
        hi, lo = _bracket(x_ptr + b.to(tl.int64) * stride_xb, n, K, SAMPLE, G, margin, margin_lo, RB)
        tl.store(br_ptr + b * 2, hi)
        tl.store(br_ptr + b * 2 + 1, lo)


@triton.jit
def _rank_key(x, valid):
    """Signed int32 in the float order (`_ukey`'s): every NaN the largest but one below INT32_MAX
    (key + 1 does not wrap); invalid -> INT32_MIN."""
    return tl.where(x != x, 0x7FFFFFFE, _ukey(x, valid) ^ -2147483648)


@triton.jit
def _rank_kernel(
    x_ptr, len_ptr, out_ptr, pt_ptr, L, stride_xb, stride_ob, stride_ptb, stride_ptp, PAGE_SIZE,
    K: tl.constexpr, T: tl.constexpr, BJ: tl.constexpr, PF: tl.constexpr, PAGED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (p, b) ranks positions i in [p·T, p·T + T) of row b exactly: rank_i = #{j: key_j >
    key_i} + #{j < i: key_j == key_i} (the stable descending sort's place, ties by the lower
    position), and writes i (or its slot) to out[b, rank_i] where rank_i < K. The ranks of a row's
    valid positions are 0..n-1 once each, so the row's first min(n, K) slots are written once, in
    the reference's order; this program also writes -1 to the slots p·T.. in [n, K)."""
    p = tl.program_id(0)
    b = tl.program_id(1)
    i0 = p * T
    i = i0 + tl.arange(0, T)
    jj = tl.arange(0, BJ)
    d0 = i0 // BJ * BJ  # the block holding this program's T positions (T divides BJ)
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    if PDL:  # launched early: the logits may still be being written
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # issued together, not one after another: the length, this program's scores, the diagonal
    # block and the first PF blocks (masked to the width; validity against the length after)
    n = tl.maximum(tl.minimum(tl.load(len_ptr + b), L), 0)
    x_i = tl.load(x_row + i, mask=i < L, other=0.0)
    x_d = tl.load(x_row + d0 + jj, mask=d0 + jj < L, other=0.0)
    x_a = tl.load(x_row + jj, mask=jj < L, other=0.0)
    x_b = x_a
    if PF == 2:  # PF blocks in flight: each block's load is issued PF steps before its compares
        x_b = tl.load(x_row + BJ + jj, mask=BJ + jj < L, other=0.0)
    if i0 < n:
        vi = i < n
        # the positions' slots now: the page table's latency hides behind the compares
        slot = _to_out(tl.where(vi, i, 0), pt_ptr + b.to(tl.int64) * stride_ptb, stride_ptp, PAGE_SIZE, PAGED)
        ki = _rank_key(x_i.to(tl.float32), vi)
        ki1 = ki + 1  # a later position must score strictly higher to outrank i
        # [BJ, T]: a thread holds few positions i and many j, so a block's threshold (ki before
        # the diagonal block, ki + 1 after it) is chosen once per i, not per pair. The counts are
        # fp32 (exact below 2^24): a compare, a select and an add a pair in the sm_90 build, where
        # int32 counts took five (the compiler's select of acc + 1, then a copy)
        acc = tl.zeros((BJ, T), dtype=tl.float32)
        for j0 in range(0, n, BJ):
            kj = _rank_key(x_a.to(tl.float32), j0 + jj < n)
            nxt = j0 + PF * BJ + jj
            if PF == 2:
                x_a = x_b
                x_b = tl.load(x_row + nxt, mask=nxt < n, other=0.0)
            else:
                x_a = tl.load(x_row + nxt, mask=nxt < n, other=0.0)
            # the diagonal block counts below (no key reaches INT32_MAX)
            thr = tl.where(j0 < d0, ki, tl.where(j0 == d0, 2147483647, ki1))
            acc += tl.where(kj[:, None] >= thr[None, :], 1.0, 0.0)
        # the diagonal block: key_j >= key_i + (j >= i), ties count for j < i only
        j = d0 + jj
        kd = _rank_key(x_d.to(tl.float32), j < n)
        acc += tl.where(kd[:, None] >= tl.where(j[:, None] >= i[None, :], ki1[None, :], ki[None, :]), 1.0, 0.0)
        rank = tl.sum(acc, axis=0).to(tl.int32)
        tl.store(out_row + rank, slot, mask=vi & (rank < K))
    tl.store(out_row + i, -1, mask=(i >= n) & (i < K))


def rank_takes(B: int, L: int) -> bool:
    """Whether `topk_triton` ranks B rows of width L in one launch (`_rank_kernel`)."""
    return B <= RANK_MAX_ROWS and L <= RANK_MAX_WIDTH and B * L * L <= RANK_MAX_PAIRS


def run_rank(logits: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, page_table: torch.Tensor | None = None,
             page_size: int = 1, tile: int | None = None, block: int | None = None, num_warps: int | None = None,
             prefetch: int | None = None, pdl: bool | None = None) -> None:
    """Launch `_rank_kernel` over `logits` [B, L] (unit column stride) into `out` [B, k]; the
    knobs (default: the RANK_* constants) are its positions a program, scores a step, warps and
    blocks in flight."""
    B, L = logits.shape
    k = out.shape[1]
    tile, block, prefetch = tile or RANK_TILE, block or RANK_BLOCK, prefetch or RANK_PREFETCH
    assert block % tile == 0 and tile & (tile - 1) == 0 and block & (block - 1) == 0, (tile, block)
    assert prefetch in (1, 2), "prefetch: 1 or 2 blocks in flight"
    assert L < 1 << 24, "rank counts are fp32: exact below 2^24"
    pt, spb, spp = _page_args(page_table, lengths, logits.device)
    interp = triton_interpreting()
    pdl = bool(logits.is_cuda if pdl is None else pdl) and not interp
    _rank_kernel[(triton.cdiv(max(L, k), tile), B)](
        logits, lengths, out, pt, L, logits.stride(0), out.stride(0), spb, spp, page_size,
        K=k, T=tile, BJ=block, PF=prefetch, PAGED=page_table is not None, PDL=pdl,
        num_warps=1 if interp else (num_warps or RANK_WARPS), **pdl_option(pdl))


@triton.jit
def _top_bit(u):
    """Index of the highest set bit of u (int32 read as unsigned); -1 for u == 0."""
    f = (u.to(tl.uint32, bitcast=True) >> 8).to(tl.float32)  # < 2^24: exact in fp32
    e = ((f.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 + 8  # bits 8..31
    low = (u & 0xFF).to(tl.float32)
    el = ((low.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.where((u >> 8) != 0, e, tl.where(low > 0, el, -1))


@triton.jit
def _cand_bin(key, lo, hi, LOGB: tl.constexpr):
    """A candidate's bin among 2^LOGB equal key ranges (a power of two wide each) spanning the
    bracket [lo << 16, hi << 16 | 0xffff]: monotone in the key. The scan and the finish both use
    it (the scan to build the row's histogram, the finish to split the candidates by it)."""
    klo = lo << 16
    khi = (hi << 16) | 0xFFFF
    span = tl.where((khi ^ -2147483648) >= (klo ^ -2147483648), khi - klo, 0)  # lo > hi: empty
    sh = tl.maximum(_top_bit(span) - LOGB + 1, 0)
    u = (key - klo).to(tl.uint32, bitcast=True) >> sh.to(tl.uint32)
    return tl.minimum(u, (1 << LOGB) - 1).to(tl.int32)


@triton.jit
def _key_float(u):
    """The float whose exact key is u (inverse of `_ukey` on non-NaN keys)."""
    k = u ^ -2147483648  # signed order
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _scan_step(x, offs, end, t_hi, t_lo, top, n_above, n_cand, aseg, cseg,
               CAPA: tl.constexpr, CAPG: tl.constexpr, MASKED: tl.constexpr):
    """Classify and compact one block: x, offs are [T, J, VEC], thread-row t holding the V = J*VEC
    consecutive positions t*V .. t*V + V - 1 (j-major). One int per score carries both counts
    (1 = above, 0x10000 = candidate), so one prefix sum over the thread totals ranks both."""
    # x < t is false for NaN: NaN gets `top` (1 = above, or a candidate when nothing is above)
    p = tl.where(x < t_hi, tl.where(x < t_lo, 0, 0x10000), top)
    if MASKED:
        p = tl.where(offs < end, p, 0)
    # (3-d, broadcast over VEC: a [T, J] or [T, J, 1] tensor gets a layout that splits J over
    # threads, or one the scan lowering rejects)
    rows = tl.broadcast_to(tl.sum(p, axis=2, keep_dims=True), p.shape)  # [T, J, VEC]: row j's total
    thr = tl.sum(tl.sum(p, axis=2), axis=1)  # [T] one thread's total
    tot = tl.sum(thr, axis=0)
    if tot > 0:
        # exclusive rank of every score in the chunk's two segments, both halves at once: the
        # running counts enter clamped to the capacities, so neither half carries over
        base = tl.minimum(n_above, CAPA) + (tl.minimum(n_cand, CAPG) << 16)
        row_ex = tl.cumsum(rows, axis=1) - rows + (tl.cumsum(thr, axis=0) - thr + base)[:, None, None]
        ex = tl.cumsum(p, axis=2) - p + row_ex
        # a block that would overflow a segment stores nothing to it: the finish never reads a
        # segment whose count exceeds its capacity (so no per-score capacity test)
        n_above += tot & 0xFFFF
        n_cand += tot >> 16
        # (scalar selects, not `& scalar`: one compare per score, and the interpreter accepts it)
        tl.store(aseg + (ex & 0xFFFF), offs, mask=p == tl.where(n_above <= CAPA, 1, -1))
        # a candidate is (position << 32 | fp32 bits): one 8-byte store
        bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        tl.store(cseg + (ex >> 16), (offs.to(tl.int64) << 32) | bits, mask=p > tl.where(n_cand <= CAPG, 1, 0x10000))
    return n_above, n_cand


@triton.jit
def _scan_kernel(
    x_ptr, len_ptr, br_ptr, stat_ptr, aseg_ptr, cseg_ptr, hist_ptr, L, stride_xb, CHUNK, C,
    K: tl.constexpr, BLOCK: tl.constexpr, V: tl.constexpr, VEC: tl.constexpr, CAPA: tl.constexpr,
    CAPG: tl.constexpr, LOGB: tl.constexpr, HB: tl.constexpr, PF: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.maximum(tl.minimum(tl.load(len_ptr + b), L), 0)
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, n)
    # loads are masked by the chunk's end in the allocated row (a multiple of 16 when L is:
    # 16-byte vector loads); the scores past the row's length are masked in the last block only
    lim = tl.minimum(start + CHUNK, L)
    # a block is [T, J, VEC]: thread-row t holds V = J * VEC consecutive positions, so the prefix
    # sum runs inside threads, then over the T thread totals only (the layout Triton picks for
    # this shape puts T across threads, J and VEC in registers)
    J: tl.constexpr = V // VEC
    T: tl.constexpr = BLOCK // V
    t_off = tl.arange(0, T)[:, None, None] * V
    jv = tl.arange(0, J)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]
    tile = t_off + jv
    x_thr = x_row + t_off  # [T, 1, 1]: + a block start + jv (constants in registers) addresses a block
    # the first PF blocks do not depend on the bracket: with PDL their loads overlap the bracket's
    # end (two cover a whole chunk at B <= 8, L = 128K), and PF blocks stay in flight in the loop
    ldlim = tl.where(n > K, lim, 0)
    nxt = tl.load(x_row + start + tile, mask=start + tile < ldlim, other=0.0)
    if PF == 2:
        nxt2 = tl.load(x_row + start + BLOCK + tile, mask=start + BLOCK + tile < ldlim, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # br is the bracket kernel's output (and stat/aseg/cseg free)
        tl.extra.cuda.gdc_launch_dependents()
    n_above = 0
    n_cand = 0
    if n > K:
        hi = tl.load(br_ptr + b * 2)
        lo = tl.load(br_ptr + b * 2 + 1)
        # the bracket as float thresholds (key16 is monotone in the score): above <=> x >= t_hi,
        # candidate <=> t_lo <= x < t_hi; NaN (the largest key) is above unless hi is the top
        has_above = hi < 65535
        t_hi = _key_float((hi + 1) << 16)  # the smallest float of key16 hi + 1 (valid: hi >= 0x7f)
        t_lo = tl.where(lo <= 0x7F, float("-inf"), _key_float(lo << 16))  # key16 <= 0x7f: -inf only
        # a score >= t_hi (or NaN) gets `top`: 1 (above), or 0x10000 (a candidate) when nothing is
        # above (then t_hi = +inf: only +inf and NaN reach it, and both are candidates). A bracket
        # with lo > hi (negative margins) has no candidates: below t_hi is then below t_lo.
        t_hi = tl.where(has_above, t_hi, float("inf"))
        top = tl.where(has_above, 1, 0x10000)
        aseg = aseg_ptr + (b * C + c).to(tl.int64) * CAPA
        cseg = cseg_ptr + (b * C + c).to(tl.int64) * CAPG
        full = start + tl.maximum(end - start, 0) // BLOCK * BLOCK
        for s in range(start, full, BLOCK):
            offs = s + tile
            x = nxt.to(tl.float32)
            # the next PF blocks' loads are in flight while this one is classified and compacted.
            # They are unmasked: a block that would cross the chunk's end in the allocation (only a
            # partial last block can) is replaced by one inside it, and reloaded masked below
            if PF == 2:
                nxt = nxt2
                nxt2 = tl.load((x_thr + tl.minimum(s + 2 * BLOCK, lim - BLOCK)) + jv)
            else:
                nxt = tl.load((x_thr + tl.minimum(s + BLOCK, lim - BLOCK)) + jv)
            n_above, n_cand = _scan_step(x, offs, end, t_hi, t_lo, top, n_above, n_cand, aseg, cseg,
                                         CAPA, CAPG, False)
        if full < end:  # the row's last, partial block
            if full + BLOCK > lim:
                nxt = tl.load(x_row + full + tile, mask=full + tile < lim)
            n_above, n_cand = _scan_step(nxt.to(tl.float32), full + tile, end, t_hi, t_lo, top, n_above,
                                         n_cand, aseg, cseg, CAPA, CAPG, True)
        if (n_cand > 0) & (n_cand <= CAPG):
            # the row's histogram of candidate bins, from this chunk's (complete) segment: the
            # finish then knows the bin of its k-th score without radix rounds
            tl.debug_barrier()  # the segment was written by other threads of this program
            for h0 in range(0, n_cand, HB):
                j = h0 + tl.arange(0, HB)
                cv = tl.load(cseg + j, mask=j < n_cand, other=0)
                key = _ukey((cv & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), j < n_cand)
                tl.atomic_add(hist_ptr + b * (1 << LOGB) + _cand_bin(key, lo, hi, LOGB), 1, mask=j < n_cand,
                              sem="relaxed")
    tl.store(stat_ptr + (b * C + c) * 2, n_above)
    tl.store(stat_ptr + (b * C + c) * 2 + 1, n_cand)


@triton.jit
def _to_out(pos, row_pt_ptr, stride_ptp, PAGE_SIZE, PAGED: tl.constexpr):
    if PAGED:
        page = tl.load(row_pt_ptr + (pos // PAGE_SIZE) * stride_ptp)
        return (page * PAGE_SIZE + pos % PAGE_SIZE).to(tl.int32)
    else:
        return pos.to(tl.int32)


@triton.jit
def _concat_segments(seg_ptr, CAP, cnt_ptr, C, dst_ptr, pt_row, stride_ptp, PAGE_SIZE,
                     MAP: tl.constexpr, PAGED: tl.constexpr, COPY: tl.constexpr):
    """Copy the C chunk segments (chunk c: cnt_ptr[2c] entries at seg_ptr + c * CAP) one after
    another to dst, in chunk (= position) order; MAP: positions become output slots on the way.
    The slow path for segments larger than their register tiles."""
    done = 0
    for ci in range(0, C):
        cnt = tl.load(cnt_ptr + ci * 2)
        for s in range(0, cnt, COPY):
            j = s + tl.arange(0, COPY)
            m = j < cnt
            v = tl.load(seg_ptr + ci * CAP + j, mask=m, other=0)
            if MAP:
                v = _to_out(v, pt_row, stride_ptp, PAGE_SIZE, PAGED)
            tl.store(dst_ptr + done + j, v, mask=m)
        done += cnt


@triton.jit
def _select_exact(key, pos, gt0, n_gt, inr, need, rem, base, out_row, pt_row, stride_ptp, PAGE_SIZE, scr_row,
                  RB: tl.constexpr, MT: tl.constexpr, PAGED: tl.constexpr):
    """Write the n_gt keys of `gt0` (already selected) and the `need` best of the `rem` in-range
    keys (ties to the lowest position) to out[base:base + n_gt + need], in any order.

    While more than MT keys are in range, radix rounds of RB bits narrow them: on the keys'
    offsets from the smallest in-range key, the first digit aligned to the top bit of their range
    (a range straddling a power of two wastes no round). The last <= MT keys are ranked pairwise
    (key, then lowest position) after a compaction through the row's scratch `scr_row`; if more
    remain once the bits run out they are all equal and the lowest positions win."""
    NB: tl.constexpr = 1 << RB
    gt = gt0
    sk = key ^ -2147483648  # signed order
    if (rem > need) & (rem > MT):
        kmin = tl.min(tl.where(inr, sk, 2147483647), axis=0) ^ -2147483648
        u = key - kmin  # offsets from the smallest in-range key (mod 2^32: exact for in-range keys)
        span = (tl.max(tl.where(inr, sk, -2147483648), axis=0) ^ -2147483648) - kmin
        shift = tl.where(span == 0, -1, tl.maximum(_top_bit(span) - RB + 1, 0))
        for rnd in range(0, 32 // RB + 1):  # a loop, not unrolled: the finish kernel is i-cache bound
            if (shift >= 0) & (rem > need) & (rem > MT):
                d = (u >> shift) & (NB - 1)
                th, above, at = _threshold(tl.histogram(d, NB, mask=inr), need, NB)
                gt = gt | (inr & (d > th))
                inr = inr & (d == th)
                need -= above
                n_gt += above
                rem = at
                shift = tl.where(shift == 0, -1, tl.maximum(shift - RB, 0))
    if (rem > need) & (rem <= MT):
        # rank the few keys left pairwise: v orders by key, then by lowest position
        v = (sk.to(tl.int64) << 32) | (0xFFFFFFFF - pos.to(tl.int64))
        # one prefix sum (a costly one here: block-wide, over layout repeats) ranks both the
        # selected keys (low half: their output slots) and those in range (their scratch slots)
        both = tl.cumsum(gt.to(tl.int32) + (inr.to(tl.int32) << 16), axis=0)
        r = (both >> 16) - 1
        tl.debug_barrier()  # a caller may have staged data in the scratch
        tl.store(scr_row + r, v, mask=inr)
        tl.debug_barrier()  # written by other threads of this program
        i = tl.arange(0, MT)
        vt = tl.load(scr_row + i, mask=i < rem, other=-9223372036854775807 - 1)
        if MT <= 64:
            better = tl.sum((vt[None, :] > vt[:, None]).to(tl.int32), axis=1)
        else:  # [MT, 32] compares at a time: a [MT, MT] tile would not fit in registers
            better = tl.zeros((MT,), dtype=tl.int32)
            for j0 in range(0, rem, 32):
                j = j0 + tl.arange(0, 32)
                vj = tl.load(scr_row + j, mask=j < rem, other=-9223372036854775807 - 1)
                better += tl.sum((vj[None, :] > vt[:, None]).to(tl.int32), axis=1)
        chosen = (i < rem) & (better < need)
        cpos = (0xFFFFFFFF - (vt & 0xFFFFFFFF)).to(tl.int32)
        # v is a total order: the chosen keys' counts of better ones are 0 .. need - 1, their slots
        tl.store(out_row + base + n_gt + better, _to_out(tl.where(chosen, cpos, 0), pt_row, stride_ptp, PAGE_SIZE,
                                                          PAGED), mask=chosen)
        sel = gt
        slot = base + (both & 0xFFFF) - 1
    else:
        # all in range selected, or every in-range key equal (bits exhausted): lowest positions win
        if rem > need:
            inr = inr & (tl.cumsum(inr.to(tl.int32), axis=0) <= need)
        sel = gt | inr
        slot = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(out_row + slot, _to_out(tl.where(sel, pos, 0), pt_row, stride_ptp, PAGE_SIZE, PAGED), mask=sel)


@triton.jit
def _finish_kernel(
    x_ptr, len_ptr, br_ptr, stat_ptr, aseg_ptr, cseg_ptr, hist_ptr, scr_ptr, out_ptr, pt_ptr,
    L, stride_xb, stride_ob, stride_ptb, stride_ptp, PAGE_SIZE, C,
    K: tl.constexpr, KP2: tl.constexpr, CB: tl.constexpr, CAPA: tl.constexpr, CAPG: tl.constexpr,
    TA: tl.constexpr, TC: tl.constexpr, RB: tl.constexpr, FB: tl.constexpr, BLOCK: tl.constexpr,
    COPY: tl.constexpr, SCR: tl.constexpr, MT: tl.constexpr, LOGB: tl.constexpr, PAGED: tl.constexpr,
    NR: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    # NR = 2 programs per row: the copier writes the scores above the bracket (and short rows),
    # the selector the candidates' share (or a fallback), in parallel; NR = 1: one does both
    copier = tl.program_id(1) == 0
    selector = tl.program_id(1) == NR - 1
    n = tl.maximum(tl.minimum(tl.load(len_ptr + b), L), 0)
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    pt_row = pt_ptr + b.to(tl.int64) * stride_ptb
    if (n <= K) & copier:
        # Every valid position is selected; -1 pads the rest (no input from the scan: with PDL
        # this runs while the scan finishes).
        for s in range(0, K, KP2):
            j = s + tl.arange(0, KP2)
            sel = j < n
            v = _to_out(tl.where(sel, j, 0), pt_row, stride_ptp, PAGE_SIZE, PAGED)
            tl.store(out_row + j, tl.where(sel, v, -1), mask=j < K)
    if PDL:
        # every program waits (not only those that read stat/aseg/cseg/scratch): this grid's end
        # then implies the scan's and the bracket's, for whatever follows it
        tl.extra.cuda.gdc_wait()
    if n > K:
        cc = tl.arange(0, CB)
        cm = cc < C
        seg0 = (b * C).to(tl.int64)
        stat = stat_ptr + (b * C + cc) * 2
        # What the usual path reads, all issued before the first use: the counts, both segment
        # tiles (whole, masked by their counts once those arrive), the histogram and the bracket.
        # One memory latency instead of a chain of them. (Each program loads the tile it uses:
        # masks from the scalar roles, as tensors.)
        na = tl.load(stat, mask=cm, other=0)
        nc = tl.load(stat + 1, mask=cm, other=0)
        ta = tl.arange(0, TA)
        t = tl.arange(0, TC)
        ca = cc < tl.where(copier, C, 0)
        cs = cc < tl.where(selector, C, 0)
        a_all = tl.load(aseg_ptr + (seg0 + cc[:, None]) * CAPA + ta[None, :], mask=ca[:, None] & (ta < CAPA)[None, :],
                        other=0)
        c_all = tl.load(cseg_ptr + (seg0 + cc[:, None]) * CAPG + t[None, :], mask=cs[:, None] & (t < CAPG)[None, :],
                        other=0)
        NBIN: tl.constexpr = 1 << LOGB
        hist = tl.load(hist_ptr + b * NBIN + tl.arange(0, NBIN))
        b_hi = tl.load(br_ptr + b * 2)
        b_lo = tl.load(br_ptr + b * 2 + 1)
        A = tl.sum(na, axis=0)
        N = tl.sum(nc, axis=0)
        usual = (A <= K) & (A + N >= K) & (N <= CB * TC)
        if usual & copier:
            # ---- the scores above the bracket, in chunk order (= position order)
            if tl.max(na, axis=0) <= TA:
                # chunk c's segment goes to out[off_c : off_c + na_c]: no scan over the elements
                a_ok = ta[None, :] < na[:, None]
                a_pos = tl.where(a_ok, a_all, 0)  # past the counts: stale workspace, never a page index
                a_slot = (tl.cumsum(na, axis=0) - na)[:, None] + ta[None, :]
                tl.store(out_row + a_slot, _to_out(a_pos, pt_row, stride_ptp, PAGE_SIZE, PAGED), mask=a_ok)
            else:  # a chunk holds more than its tile: copy chunk by chunk
                _concat_segments(aseg_ptr + seg0 * CAPA, CAPA, stat_ptr + b * C * 2, C, out_row, pt_row, stride_ptp,
                                 PAGE_SIZE, True, PAGED, COPY)
        if usual & selector:
            # ---- the candidates, gathered in position order into [CB * TC]
            if tl.max(nc, axis=0) <= TC:
                ok2 = t[None, :] < nc[:, None]
                cv = c_all
            else:  # a chunk holds more than its tile: compact through the row's scratch
                srow = scr_ptr + b.to(tl.int64) * SCR
                _concat_segments(cseg_ptr + seg0 * CAPG, CAPG, stat_ptr + b * C * 2 + 1, C, srow, pt_row, stride_ptp,
                                 PAGE_SIZE, False, PAGED, COPY)
                tl.debug_barrier()  # the scratch was written by other threads of this program
                flat = cc[:, None] * TC + t[None, :]
                ok2 = flat < N
                cv = tl.load(srow + flat, mask=ok2, other=0)
            pos = (cv >> 32).to(tl.int32)
            key = _ukey((cv & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), ok2)
            key = tl.reshape(key, (CB * TC,))
            pos = tl.reshape(pos, (CB * TC,))
            inr = tl.reshape(ok2, (CB * TC,))
            # the scan's histogram of candidate bins gives the k-th score's bin: the candidates
            # in higher bins are selected, those in it go to the exact selection (usually few
            # enough to rank pairwise). Its counts are checked against the tile's.
            t_bin, n_hi, n_at = _threshold(hist, K - A, NBIN)
            cb = _cand_bin(key, b_lo, b_hi, LOGB)
            gt0 = inr & (cb > t_bin)
            inb = inr & (cb == t_bin)
            both = tl.sum(gt0.to(tl.int32) + (inb.to(tl.int32) << 16), axis=0)
            # (not expected) counts that disagree: nothing preselected, the rounds over every candidate
            hist_ok = both == n_hi + (n_at << 16)
            # hist_ok as a tensor mask (every cb < 2^LOGB): the interpreter rejects `mask & scalar`
            okm = cb >= tl.where(hist_ok, 0, 1 << LOGB)
            gt0 = gt0 & okm
            inb = (inb & okm) | (inr & ~okm)
            n_hi = tl.where(hist_ok, n_hi, 0)
            n_at = tl.where(hist_ok, n_at, N)
            _select_exact(key, pos, gt0, n_hi, inb, K - A - n_hi, n_at, A, out_row, pt_row, stride_ptp, PAGE_SIZE,
                          scr_ptr + b.to(tl.int64) * SCR, RB, MT, PAGED)
        elif (A > K) & (A <= CB * TA) & (tl.max(na, axis=0) <= CAPA) & selector:
            # Missed high (more than K scores above the bracket), no segment truncated: the K best
            # are among them. Gather their positions (chunk by chunk, in position order), read
            # their scores back and select exactly.
            srow = scr_ptr + b.to(tl.int64) * SCR
            _concat_segments(aseg_ptr + seg0 * CAPA, CAPA, stat_ptr + b * C * 2, C, srow, pt_row, stride_ptp,
                             PAGE_SIZE, False, PAGED, COPY)
            tl.debug_barrier()  # the scratch was written by other threads of this program
            j = tl.arange(0, CB * TA)
            a_ok = j < A
            a_pos = tl.load(srow + j, mask=a_ok, other=0).to(tl.int32)
            x_row = x_ptr + b.to(tl.int64) * stride_xb
            a_key = _ukey(tl.load(x_row + a_pos, mask=a_ok, other=0.0).to(tl.float32), a_ok)
            _select_exact(a_key, a_pos, a_ok & False, A * 0, a_ok, A * 0 + K, A, 0, out_row, pt_row, stride_ptp,
                          PAGE_SIZE, srow, RB, MT, PAGED)
        elif selector:
            # Exact fallback over the row itself: FB-bit radix rounds, one streaming pass each.
            x_row = x_ptr + b.to(tl.int64) * stride_xb
            NF: tl.constexpr = 1 << FB
            need = K
            pmask = 0
            pval = 0
            for rnd in range(0, 32 // FB):
                shift = 32 - FB * (rnd + 1)
                h = tl.zeros((NF,), dtype=tl.int32)
                for s in range(0, n, BLOCK):
                    offs = s + tl.arange(0, BLOCK)
                    valid = offs < n
                    key = _ukey(tl.load(x_row + offs, mask=valid, other=0.0).to(tl.float32), valid)
                    h += tl.histogram((key >> shift) & (NF - 1), NF, mask=valid & ((key & pmask) == pval))
                th, above, _ = _threshold(h, need, NF)
                need -= above
                pval = pval | (th << shift)  # int32, wraps like the keys
                pmask = -(1 << shift)  # the bits fixed so far (int32)
            ties = 0
            written = 0
            for s in range(0, n, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                valid = offs < n
                key = _ukey(tl.load(x_row + offs, mask=valid, other=0.0).to(tl.float32), valid)
                # unsigned compare of the exact keys: flip bit 31 back to compare as signed
                gt = valid & ((key ^ -2147483648) > (pval ^ -2147483648))
                tie = valid & (key == pval)
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


def _chunks(B: int, L: int, device: torch.device, block: int, max_chunks: int,
            chunks: int | None = None) -> tuple[int, int]:
    """(C, CHUNK): split each row so that B*C programs cover the machine about twice (H200, scan
    holding one block in flight: at 64 x 128K, 8 chunks a row 30.0 us against 16 chunks 30.4; at
    64 x 32K 18.8 against 19.8), or into `chunks` (at most one block each)."""
    blocks = triton.cdiv(max(L, 1), block)
    if chunks is None:
        chunks = min(max_chunks, triton.next_power_of_2(triton.cdiv(2 * _num_sms(device), max(B, 1))))
    c = max(1, min(blocks, chunks))
    chunk = triton.cdiv(blocks, c) * block
    return triton.cdiv(max(L, 1), chunk), chunk


def expected_candidates(n: int, k: int, sample: int = SAMPLE, margin: float = MARGIN,
                        margin_lo: float | None = None) -> float:
    """Scores of a row of n that fall in the bracket on average: its width in sample ranks
    (margin + margin_lo standard deviations, + 8), n / S scores each."""
    if n <= sample:
        return 0.0
    m = k * sample / n
    lo = margin + LO_EXTRA if margin_lo is None else margin_lo
    return ((max(margin, 0.0) + max(lo, 0.0)) * m**0.5 + 8) * n / sample


def row_sample(L: int) -> int:
    """The bracket's sample tile for rows of width L: SHORT_SAMPLE up to SHORT_SAMPLE_MAX_WIDTH,
    SAMPLE past it, or the width's power of two (at least MIN_SAMPLE) when smaller. Such rows are
    sampled whole either way (an exact bracket); a tile past the width only costs the radix rounds
    over it (H100, one row of 313 scores, k = 64: 10.9 µs a top-k with 4096, 7.0 with 1024, 6.5
    with 512; benchmarks/history/2026-12-05.md)."""
    cap = SHORT_SAMPLE if L <= SHORT_SAMPLE_MAX_WIDTH else SAMPLE
    return min(cap, max(MIN_SAMPLE, triton.next_power_of_2(max(L, 1))))


def _cand_tile(L: int, k: int, sample: int, margin: float, margin_lo: float | None = None) -> int:
    """The finish kernel's candidate tile: 1.5x the expected count at the longest row (the count
    grows with n; the largest of 64 Gaussian rows measured 1.2-1.3x), a power of two in
    [1024, 8192]. Larger tiles cost the finish time."""
    want = 1.5 * max(expected_candidates(n, k, sample, margin, margin_lo) for n in (min(L, 2 * sample), L))
    return min(8192, max(1024, triton.next_power_of_2(int(want))))


@dataclass
class TopkPlan:
    """One call's shape-derived sizes and workspace (everything but the inputs and the output)."""

    k: int
    C: int  # programs per row in the scan
    chunk: int  # scores per scan program
    CB: int  # C rounded up to a power of two
    TA: int  # the finish's register tile of "above" positions per chunk
    TC: int  # ... and of candidates per chunk (CB * TC = the candidate budget)
    CAPA: int  # per-chunk segment capacities in the workspace
    CAPG: int
    SCR: int  # a row's scratch: overflowing candidates, or a missed-high row's positions
    br: torch.Tensor  # [B, 2] each row's bracket (hi, lo)
    hist: torch.Tensor  # [B, NBIN] each row's candidates per bin (`_cand_bin`)
    stat: torch.Tensor  # [B, C, 2] per-chunk counts (above, candidates)
    aseg: torch.Tensor  # [B, C, CAPA] positions above the bracket
    cseg: torch.Tensor  # [B, C, CAPG] candidates (position << 32 | fp32 bits)
    scratch: torch.Tensor  # [B, SCR]


def plan_topk(B: int, L: int, k: int, device: torch.device, cand_total: int | None = None,
              sample: int | None = None, margin: float = MARGIN, margin_lo: float | None = None,
              block: int = BLOCK, max_chunks: int = MAX_CHUNKS, chunks: int | None = None) -> TopkPlan:
    C, chunk = _chunks(B, L, device, block, max_chunks, chunks)
    CB = triton.next_power_of_2(C)
    if cand_total is None:
        cand_total = _cand_tile(L, k, sample or row_sample(L), margin, margin_lo)
    cand_total = triton.next_power_of_2(max(cand_total, CB))
    TA = max(2 * triton.next_power_of_2(k) // CB, 16)  # 2x an even share
    CAPA, CAPG = min(k, chunk), min(cand_total, chunk)  # what a valid bracket can put in a chunk
    SCR = max(cand_total, CB * TA)

    def buf(*shape, dtype=torch.int32):
        return torch.empty(shape, dtype=dtype, device=device)

    return TopkPlan(k, C, chunk, CB, TA, cand_total // CB, CAPA, CAPG, SCR, buf(B, 2), buf(B, NBIN), buf(B, C, 2),
                    buf(B, C, CAPA), buf(B, C, CAPG, dtype=torch.int64), buf(B, SCR, dtype=torch.int64))


def run_topk(plan: TopkPlan, logits: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
             page_table: torch.Tensor | None = None, page_size: int = 1, sample: int | None = None,
             margin: float = MARGIN, margin_lo: float | None = None, block: int = BLOCK, rbits: int = RBITS,
             num_warps: int | None = None, bracket_warps: int | None = None, stages: int = 3,
             scan_v: int | None = None, pdl: bool | None = None, first: int = 1,
             select_tile: int = SELECT_TILE, finish_warps: int | None = None, scan_prefetch: int = SCAN_PREFETCH,
             finish_split: bool | None = None) -> None:
    """Launch the bracket, scan and finish kernels of `plan` (stages `first`..`stages` of them, 1-based:
    the benchmark's probe times prefixes, tests run the scan on brackets of their own).
    `logits` has unit column stride, `lengths` is int32.

    `scan_prefetch`: blocks each scan program keeps in flight (1 or 2). `finish_split`: two finish
    programs per row, the scores above the bracket copied beside the candidates' selection
    (default: when both fit the SMs in one wave, 2B <= SMs).
    `scan_v`: consecutive scores per thread in the scan (default: a block spans the program's
    threads once). `pdl`: programmatic dependent launch (default: on for CUDA tensors unless
    interpreting): each kernel is launched while its predecessor runs and waits (griddepcontrol)
    before it reads what the predecessor writes or writes what it may still read; every program
    waits, so a kernel's end implies its predecessors' ends. `select_tile`: see `_select_exact`."""
    assert select_tile & (select_tile - 1) == 0 and 16 <= select_tile <= 256, "select_tile: a power of two in [16, 256]"
    assert scan_prefetch in (1, 2), "scan_prefetch: 1 or 2"
    B, L = logits.shape
    assert L < 1 << 27, "rows longer than the 27-bit counts of `_threshold`"
    sample = sample or row_sample(L)
    p = plan
    pt, spb, spp = _page_args(page_table, lengths, logits.device)
    interp = triton_interpreting()
    warps = num_warps or (8 if not interp else 1)
    margin_lo = margin + LO_EXTRA if margin_lo is None else margin_lo
    if pdl is None:
        pdl = logits.is_cuda and not interp
    pdl = bool(pdl) and not interp  # griddepcontrol is inline PTX: the interpreter cannot run it
    launch = pdl_option(pdl)
    vec = 16 // logits.element_size()  # one 16-byte load
    v = scan_v or max(block // (32 * warps), vec)
    vec = min(vec, v)
    # at most 64 registers (no spills up to 8 scores a thread): 4 programs of 8 warps per SM, each
    # with `scan_prefetch` blocks in flight (uncapped, 2 blocks take ~95 and 2 programs fit)
    scan_regs = dict(maxnreg=64) if block // (32 * warps) <= 8 and not interp else {}
    assert block % v == 0 and v % vec == 0 and (block // v) & (block // v - 1) == 0, (block, v)
    # the scan ranks both segments in one int32 (above in the low half, candidates in the high)
    assert p.CAPA + block < 1 << 16 and p.CAPG + block < 1 << 15, "segment capacity too large for the scan"
    # the finish ranks two counts over its tiles in one int32 (`_select_exact`)
    assert max(p.CB * p.TA, p.CB * p.TC) < 1 << 16, "finish tiles too large"
    if first <= 1 <= stages:
        _bracket_kernel[(B,)](logits, lengths, p.br, p.hist, L, logits.stride(0), margin, margin_lo,
                              K=p.k, SAMPLE=sample, G=GROUP, RB=rbits, LOGB=LOGB, PDL=pdl,
                              num_warps=bracket_warps or (16 if not interp else 1), **launch)
    if first <= 2 <= stages:
        _scan_kernel[(B, p.C)](logits, lengths, p.br, p.stat, p.aseg, p.cseg, p.hist, L, logits.stride(0), p.chunk,
                               p.C, K=p.k, BLOCK=block, V=v, VEC=vec, CAPA=p.CAPA, CAPG=p.CAPG, LOGB=LOGB,
                               HB=32 * warps, PF=scan_prefetch, PDL=pdl, num_warps=warps, **launch, **scan_regs)
    if first <= 3 <= stages:
        split = 2 * B <= _num_sms(logits.device) if finish_split is None else finish_split
        nr = 2 if split else 1
        _finish_kernel[(B, nr)](logits, lengths, p.br, p.stat, p.aseg, p.cseg, p.hist, p.scratch, out, pt,
                                L, logits.stride(0), out.stride(0), spb, spp, page_size, p.C,
                                K=p.k, KP2=min(triton.next_power_of_2(p.k), 4096), CB=p.CB, CAPA=p.CAPA,
                                CAPG=p.CAPG, TA=p.TA, TC=p.TC, RB=rbits, FB=FALLBACK_BITS, BLOCK=block, COPY=256,
                                SCR=p.SCR, MT=select_tile, LOGB=LOGB, PAGED=page_table is not None, NR=nr, PDL=pdl,
                                num_warps=finish_warps or warps, **launch)


def _page_args(page_table: torch.Tensor | None, lengths: torch.Tensor,
               device: torch.device) -> tuple[torch.Tensor, int, int]:
    """The page table as the kernels read it and its strides (with no table: any pointer, never read)."""
    if page_table is None:
        return lengths, 0, 0
    pt = page_table.to(device=device, dtype=torch.int32)
    return pt, pt.stride(0), pt.stride(1)


def topk_triton(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    page_table: torch.Tensor | None = None,
    page_size: int = 1,
    cand_total: int | None = None,
    sample: int | None = None,
    margin: float = MARGIN,
    margin_lo: float | None = None,
    block: int = BLOCK,
    max_chunks: int = MAX_CHUNKS,
    rbits: int = RBITS,
    num_warps: int | None = None,
    bracket_warps: int | None = None,
    scan_v: int | None = None,
    pdl: bool | None = None,
    select_tile: int = SELECT_TILE,
    finish_warps: int | None = None,
    scan_prefetch: int = SCAN_PREFETCH,
    finish_split: bool | None = None,
    chunks: int | None = None,
    rank: bool | None = None,
) -> torch.Tensor:
    """[B, k] int32 positions (or physical slots with `page_table`), -1 padded. The keyword
    arguments after `page_size` are tuning knobs; tests shrink `cand_total`, `sample` and the
    margins to force the overflow, re-selection and fallback paths. `rank`: one launch
    (`_rank_kernel`) or the three (default: `rank_takes`); the knobs before it are the three's."""
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    B, L = logits.shape
    sample = sample or row_sample(L)
    assert rbits in (1, 2, 4, 8) and sample % GROUP == 0 and sample & (sample - 1) == 0
    out = torch.empty((B, k), dtype=torch.int32, device=logits.device)
    if B == 0 or k == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lengths = lengths.to(device=logits.device, dtype=torch.int32).contiguous()
    if rank is None:
        rank = rank_takes(B, L)
    if rank:
        run_rank(logits, lengths, out, page_table, page_size, pdl=pdl)
        return out
    plan = plan_topk(B, L, k, logits.device, cand_total, sample, margin, margin_lo, block, max_chunks, chunks)
    run_topk(plan, logits, lengths, out, page_table, page_size, sample, margin, margin_lo, block, rbits,
             num_warps, bracket_warps, scan_v=scan_v, pdl=pdl, select_tile=select_tile,
             finish_warps=finish_warps, scan_prefetch=scan_prefetch, finish_split=finish_split)
    return out

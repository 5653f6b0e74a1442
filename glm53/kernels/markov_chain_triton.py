"""DSpark's greedy Markov chain as one Triton launch per block position.

Position i's proposal is argmax_v(base[i, v] + markov_w2[v] · markov_w1[token_{i−1}]), token_{−1}
the anchor. In torch that is four kernels a position (the w1 row's gather, the [r] × [r, V]
product, the add, the argmax), ~60 launches a block of 16 on a vocabulary that one launch covers.
Here a launch for position i has a program per (row, slice of BLOCK_V tokens): it first reduces
position i − 1's per-slice maxima to that position's token (the chain's only dependency, read
from the previous launch's output), then scores its slice and writes its own maximum and where
it lies. Ties pick the lowest token id, as torch.argmax does. A last launch reduces the final
position. The sums run in fp32 like the reference's product, in another order: a token may differ
from the reference only where two scores lie within fp32 rounding of each other.

The confidence cut (`confidence_keep_triton`) is one launch, a program per row, or no launch of
its own after the chain (`markov_chain_keep_triton`: the chain's last launch makes it): every
position's dot product with proj ([h_i, markov_w1[token_{i−1}]], fp32, in another order than the
reference's product), its sigmoid, and the count of leading positions at or above the threshold;
a keep may differ from the reference only where a confidence lies within fp32 rounding of the
threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["i"])  # one compiled kernel for every position
def _markov_step_kernel(base_ptr, anchor_ptr, w1_ptr, w2_ptr, best_ptr, where_ptr, tok_ptr, i, n, V, NB,
                        stride_br, stride_bi, h_ptr, pw_ptr, pb_ptr, keep_ptr, H, thr, stride_hr, stride_hi,
                        R: tl.constexpr, BLOCK_V: tl.constexpr, NB_PAD: tl.constexpr, CUT: tl.constexpr,
                        NP: tl.constexpr, BH: tl.constexpr):
    """CUT: the last launch (i = n) also makes the confidence cut (`_keep_row`): it reads the
    tokens before each position, 0 .. n − 2, which the launches before it wrote."""
    row = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    part = row * n * NB  # this row's [n, NB] maxima and their token ids
    if i == 0:
        prev = tl.load(anchor_ptr + row)
    else:
        b = tl.arange(0, NB_PAD)
        live = b < NB
        best = tl.load(best_ptr + part + (i - 1) * NB + b, mask=live, other=float("-inf"))
        at = tl.load(where_ptr + part + (i - 1) * NB + b, mask=live, other=V)
        top = tl.max(best, 0)
        prev = tl.min(tl.where(best == top, at, V), 0).to(tl.int64)
        if sl == 0:
            tl.store(tok_ptr + row * n + i - 1, prev)
    if i < n:
        k = tl.arange(0, R)
        e = tl.load(w1_ptr + prev * R + k).to(tl.float32)
        v = sl * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = v < V
        w = tl.load(w2_ptr + v[:, None].to(tl.int64) * R + k[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        score = tl.sum(w * e[None, :], 1) + tl.load(base_ptr + row * stride_br + i * stride_bi + v, mask=ok,
                                                     other=0.0).to(tl.float32)
        score = tl.where(ok, score, float("-inf"))
        top = tl.max(score, 0)
        tl.store(best_ptr + part + i * NB + sl, top)
        tl.store(where_ptr + part + i * NB + sl, tl.min(tl.where(score == top, v, V), 0))
    elif CUT:
        _keep_row(row, h_ptr, anchor_ptr, tok_ptr, w1_ptr, pw_ptr, pb_ptr, keep_ptr, n, H, thr, stride_hr, stride_hi,
                  R, R, NP, BH)


def default_block_v(rows: int, vocab: int) -> int:
    """Tokens a program scores: about a thousand programs a launch, 32 to 256 tokens each. Each
    launch is short, so the latency of one program's loads decides it. On the H200 (16 launches,
    a CUDA graph): V 4,160 (the embedded DSpark draft) at one row 36.5 µs with 32 against 72.2
    with 512 (torch's four kernels a position: 137.3), at 16 rows 57.9 with 128 (53.0 with 64);
    V 154,880 at one row 87.7 with 256 against 152.9 with 64."""
    return min(256, max(32, triton.next_power_of_2(max(1, rows * vocab // 1024))))


def markov_chain_triton(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        block_v: int | None = None) -> torch.Tensor:
    """base [R, n, V] fp32 or the lm_head's dtype (rows contiguous in V; read as fp32), anchor [R]
    long, w1 / w2 [V, r] (r a power of two) -> tokens [R, n] long. `block_v` (None:
    `default_block_v`) changes the speed only."""
    return _chain(base, anchor, w1, w2, block_v)[0]


def markov_chain_keep_triton(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                             hidden: torch.Tensor, proj_w: torch.Tensor, proj_b: torch.Tensor, threshold: float,
                             block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain, then the confidence cut (`confidence_keep_triton`'s arguments and result) in
    its last launch: one launch fewer than the two ops, the same values bit for bit (the cut's
    code and warps)."""
    assert proj_w.shape == (1, hidden.shape[2] + w1.shape[1]) and hidden.shape[:2] == base.shape[:2]
    assert hidden.stride(2) == 1
    cut = (hidden, proj_w.contiguous(), proj_b, float(threshold))
    return _chain(base, anchor, w1, w2, block_v, cut)


def _chain(base, anchor, w1, w2, block_v, cut=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    R_, n, V = base.shape
    r = w1.shape[1]
    assert base.is_floating_point() and base.stride(2) == 1 and w1.shape == w2.shape == (V, r)
    assert r & (r - 1) == 0, f"the Markov rank must be a power of two here, got {r}"
    tokens = torch.empty((R_, n), dtype=torch.long, device=base.device)
    keep = None if cut is None else torch.empty(R_, dtype=torch.long, device=base.device)  # the last launch's
    if R_ == 0 or n == 0:
        return tokens, None if keep is None else keep.zero_()
    block_v = block_v or default_block_v(R_, V)
    nb = triton.cdiv(V, block_v)
    best = torch.empty((R_, n, nb), dtype=torch.float32, device=base.device)
    where = torch.empty((R_, n, nb), dtype=torch.int32, device=base.device)
    w1, w2, anchor = w1.contiguous(), w2.contiguous(), anchor.contiguous()
    hidden, proj_w, proj_b, thr = cut or (base, base, base, 0.0)  # unread without the cut
    H = hidden.shape[2]
    for i in range(n + 1):  # launch n reduces the last position (and makes the cut) only
        _markov_step_kernel[(R_, nb if i < n else 1)](
            base, anchor, w1, w2, best, where, tokens, i, n, V, nb, base.stride(0), base.stride(1),
            hidden, proj_w, proj_b, tokens if keep is None else keep, H, thr, hidden.stride(0), hidden.stride(1),
            R=r, BLOCK_V=block_v, NB_PAD=triton.next_power_of_2(nb), CUT=cut is not None,
            NP=triton.next_power_of_2(n), BH=min(128, triton.next_power_of_2(H)), num_warps=4)
    return tokens, keep


@triton.jit
def _keep_row(row, h_ptr, anchor_ptr, tok_ptr, w1_ptr, pw_ptr, pb_ptr, keep_ptr, n, H, thr, stride_hr, stride_hi,
              R: tl.constexpr, RP: tl.constexpr, NP: tl.constexpr, BH: tl.constexpr):
    """Row `row`'s confidences and keep (the cut's whole arithmetic: its kernel and the chain's
    last launch run this)."""
    i = tl.arange(0, NP)
    live = i < n
    acc = tl.zeros((NP,), dtype=tl.float32)
    for h0 in range(0, H, BH):  # the hidden part of the product, BH columns at a time
        c = h0 + tl.arange(0, BH)
        cm = c < H
        x = tl.load(h_ptr + row * stride_hr + i[:, None] * stride_hi + c[None, :], mask=live[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x * tl.load(pw_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :], 1)
    # the Markov part: markov_w1 of the token before each position (the anchor before position 0)
    prev = tl.load(tok_ptr + row * n + i - 1, mask=live & (i > 0), other=0)
    prev = tl.where(i == 0, tl.load(anchor_ptr + row), prev).to(tl.int64)
    k = tl.arange(0, RP)
    km = k < R
    e = tl.load(w1_ptr + prev[:, None] * R + k[None, :], mask=live[:, None] & km[None, :], other=0.0).to(tl.float32)
    acc += tl.sum(e * tl.load(pw_ptr + H + k, mask=km, other=0.0).to(tl.float32)[None, :], 1)
    conf = 1.0 / (1.0 + tl.exp(-(acc + tl.load(pb_ptr).to(tl.float32))))
    tl.store(keep_ptr + row, tl.min(tl.where(live & (conf < thr), i, n), 0).to(tl.int64))


@triton.jit
def _confidence_keep_kernel(h_ptr, anchor_ptr, tok_ptr, w1_ptr, pw_ptr, pb_ptr, keep_ptr, n, H, thr,
                            stride_hr, stride_hi, R: tl.constexpr, RP: tl.constexpr, NP: tl.constexpr,
                            BH: tl.constexpr):
    _keep_row(tl.program_id(0).to(tl.int64), h_ptr, anchor_ptr, tok_ptr, w1_ptr, pw_ptr, pb_ptr, keep_ptr, n, H, thr,
              stride_hr, stride_hi, R, RP, NP, BH)


def confidence_keep_triton(hidden: torch.Tensor, anchor: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor,
                           proj_w: torch.Tensor, proj_b: torch.Tensor, threshold: float) -> torch.Tensor:
    R_, n, H = hidden.shape
    r = w1.shape[1]
    assert proj_w.shape == (1, H + r) and tokens.shape == (R_, n) and hidden.stride(2) == 1
    keep = torch.empty(R_, dtype=torch.long, device=hidden.device)
    if R_:
        _confidence_keep_kernel[(R_,)](
            hidden, anchor.contiguous(), tokens, w1.contiguous(), proj_w.contiguous(), proj_b, keep, n, H,
            threshold, hidden.stride(0), hidden.stride(1), R=r, RP=triton.next_power_of_2(r),
            NP=triton.next_power_of_2(max(n, 1)), BH=min(128, triton.next_power_of_2(H)), num_warps=4,
        )
    return keep

"""`qk_heads` as Triton kernels: a program finishes one head of one row (`finish_qk_heads`), or
one layer's K and V head of one context row into the pool (`store_context_kv`).

The head is loaded whole for the norm's statistics, reduced as `norm_triton` reduces a row of that
width (same vector, same warps), so rstd is the same number. The rotation's partner (column
j ± D/2) is loaded again and normed the same way, so no value moves between threads; each output
is `rotate_pair` of the two normed values, as `rope_triton` rounds it. A program loads its head
before it stores it, so the keys are finished in place. The context rows' cos/sin are libdevice's
(torch's CUDA cos/sin) of the same fp32 product as `rope.rope_cos_sin`; the interpreter has no
libdevice and runs `tl.cos`/`tl.sin`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting
from glm53.kernels.rope_triton import cos_sin, rotate_pair


@triton.jit
def normed_rotated(src, w_ptr, c, s, eps, D: tl.constexpr, dt: tl.constexpr):
    """The D values of one head at `src`, RMS-normed (weight at `w_ptr`) and rotated on halves;
    c / s [D] fp32, already rounded to dt, per output column (cos of pair j % D/2; sin on the first
    half, −sin on the second). Rounded as `norm_triton` then `rope_triton` round: normalise in fp32,
    round, times the weight, round; `rotate_pair`."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    x = tl.load(src + d).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    n = (tl.load(w_ptr + d).to(tl.float32) * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    p = (d + HALF) % D  # the partner, loaded again and normed the same way
    xp = tl.load(src + p).to(tl.float32)
    npart = (tl.load(w_ptr + p).to(tl.float32) * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # o1 = x1·c − x2·s on the first half, o2 = x2·c + x1·s on the second (rope_triton's pairs)
    return rotate_pair(n, npart, c, s, dt)


@triton.jit
def _qk_heads_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, stride_q, stride_k, stride_c, eps,
                     HQ: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, B: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    dt = out_ptr.dtype.element_ty
    if h < HQ:  # a query head: to its place in [R, HK, G, B, D]
        src = q_ptr + t * stride_q + h * D
        w_ptr = qw_ptr
        dst = out_ptr + ((((t // B) * HK + h // G) * G + h % G) * B + t % B) * D
    else:  # a key head: in place
        src = k_ptr + t * stride_k + (h - HQ) * D
        w_ptr = kw_ptr
        dst = src
    d = tl.arange(0, D)
    j = d % HALF
    c = tl.load(cos_ptr + t * stride_c + j).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + j).to(dt).to(tl.float32)
    tl.store(dst + d, normed_rotated(src, w_ptr, c, tl.where(d < HALF, s, -s), eps, D, dt))


@triton.jit
def _context_kv_kernel(x_ptr, w_ptr, pos_ptr, slot_ptr, inv_ptr, pool_ptr, stride_x, stride_pp, stride_ph,
                       stride_pl, stride_po, eps, L: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                       PS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (t, l·KV + h): context row t's K (normed, rotated at its position) and V of draft
    layer l, KV head h, from x [N, L, 2, KV, D] (rows strided), into the pool's slot of row t."""
    t = tl.program_id(0).to(tl.int64)
    lh = tl.program_id(1)
    layer = lh // KV
    h = lh % KV
    HALF: tl.constexpr = D // 2
    dt = pool_ptr.dtype.element_ty
    d = tl.arange(0, D)
    c, s = cos_sin(tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + d % HALF), LIBDEVICE)
    c = c.to(dt).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    src = x_ptr + t * stride_x + (layer * 2 * KV + h) * D
    k = normed_rotated(src, w_ptr + layer * D, c, tl.where(d < HALF, s, -s), eps, D, dt)
    v = tl.load(src + KV * D + d)
    slot = tl.load(slot_ptr + t)
    dst = pool_ptr + (slot // PS) * stride_pp + layer * stride_pl + (slot % PS) * stride_po + d
    tl.store(dst + (2 * h) * stride_ph, k)
    tl.store(dst + (2 * h + 1) * stride_ph, v.to(dt))


def finish_qk_heads_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, cos: torch.Tensor, sin: torch.Tensor, block: int, hq: int,
                           hk: int) -> torch.Tensor:
    n, d = q.shape[0], q_weight.shape[0]
    g = hq // hk
    out = torch.empty((n // block, hk, g * block, d), dtype=q.dtype, device=q.device)
    if n:
        _qk_heads_kernel[(n, hq + hk)](
            q, k, q_weight, k_weight, cos, sin, out, q.stride(0), k.stride(0), cos.stride(0), eps,
            HQ=hq, HK=hk, G=g, B=block, D=d, num_warps=max(1, min(16, d // 256)),  # norm_triton's warps
        )
    return out


def store_context_kv_triton(x: torch.Tensor, k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                            out_slots: torch.Tensor, inv_freq: torch.Tensor, pool: torch.Tensor) -> None:
    n, nl, _, kv, d = x.shape
    if n:
        _context_kv_kernel[(n, nl * kv)](
            x, k_weight, positions, out_slots, inv_freq, pool, x.stride(0), pool.stride(0), pool.stride(1),
            pool.stride(2), pool.stride(3), eps, L=nl, KV=kv, D=d, PS=pool.shape[3], LIBDEVICE=not triton_interpreting(),
            num_warps=max(1, min(16, d // 256)),  # norm_triton's warps
        )

"""`qk_heads.finish_qk_heads` as one Triton kernel: a program finishes one head of one row.

The head is loaded whole for the norm's statistics, reduced as `norm_triton` reduces a row of that
width (same vector, same warps), so rstd is the same number. The rotation's partner (column
j ± D/2) is loaded again and normed the same way, so no value moves between threads; each output
is `rotate_pair` of the two normed values, as `rope_triton` rounds it. A program loads its head
before it stores it, so the keys are finished in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.rope_triton import rotate_pair


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
    x = tl.load(src + d).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    # normalise in fp32, round, times the weight, round (norm_triton); then the partner the same way
    n = (tl.load(w_ptr + d).to(tl.float32) * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    p = (d + HALF) % D
    xp = tl.load(src + p).to(tl.float32)
    npart = (tl.load(w_ptr + p).to(tl.float32) * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    j = d % HALF
    c = tl.load(cos_ptr + t * stride_c + j).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + j).to(dt).to(tl.float32)
    # o1 = x1·c − x2·s on the first half, o2 = x2·c + x1·s on the second (rope_triton's pairs)
    tl.store(dst + d, rotate_pair(n, npart, c, tl.where(d < HALF, s, -s), dt))


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

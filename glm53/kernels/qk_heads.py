"""The draft's attention heads finished in one op each: RMS-normed over head_dim (q_norm, k_norm)
and rotated (RoPE on halves). `finish_qk_heads`: a drafting block's queries and keys, the queries
written where the draft attention reads them. `store_context_kv`: the context rows' K and V of
every draft layer, written into the `draft_kv` pool at their slots.

On the ops path that is a norm and a rotation of q, the same of k, and a copy gathering the query
heads of each KV head ([R, kv, group·B, hd]; a view when group is 1): four or five launches a
draft layer, each costing more than its work on a drafting step of a few rows. `qk_heads_triton`
does it in one launch, a program per (row, head): the queries to a new tensor, the keys in place,
so that they keep the strides of the values beside them in one fused q|k|v product (the
attention takes K and V with one set of strides). Its roundings are the two kernels' (`norm_triton`
then `rope_triton.rotate_pair`): on one device the result equals the ops' bit for bit, which
matters because the drafts were distilled against exact roundings (history, 2026-12-04).

The context rows' ops normalised K with torch's reduction (a weight per layer is not one vector
for `norm_triton`), a rotation, a stack, a split of the slots and an indexed store: ~16 launches a
step. `store_context_kv` is one; its K is normed as the draft's own layers norm theirs
(`norm_triton`'s reduction), which may differ from torch's mean in the last bit of rstd.
"""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import use_triton
from glm53.kernels.norm import rms_norm
from glm53.kernels.rope import apply_rope, rope_cos_sin


def _check(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
           block: int) -> tuple[int, int, int, int]:
    n, d = q.shape[0], q_weight.shape[0]
    if q.dim() != 2 or k.dim() != 2 or k.shape[0] != n or k_weight.shape != (d,) or q.shape[1] % d or k.shape[1] % d:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} are not rows of heads of {d}")
    hq, hk = q.shape[1] // d, k.shape[1] // d
    if hk == 0 or hq % hk or block <= 0 or n % block or cos.shape != (n, d // 2):
        raise ValueError(f"{hq} query heads over {hk} KV heads, {n} rows in blocks of {block}, cos {tuple(cos.shape)}")
    return n, d, hq, hk


def finish_qk_heads(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    cos: torch.Tensor, sin: torch.Tensor, block: int) -> torch.Tensor:
    """q [N, Hq·D] and k [N, Hk·D] (unit last stride; rows may be strided, e.g. members of one
    fused product) of N = R·block rows, R requests' blocks; q_weight / k_weight [D]; cos / sin
    [N, D/2] fp32. Finishes k in place and returns the finished queries [R, Hk, G·block, D]
    (G = Hq / Hk: query head h reads KV head h // G; row g·block + i is head g of the group at block
    position i). Device ops only: safe under CUDA graph capture."""
    n, d, hq, hk = _check(q, k, q_weight, k_weight, cos, block)
    half = d // 2
    fits = (q.stride(1) == 1 and k.stride(1) == 1 and cos.stride() == sin.stride() and cos.stride(1) == 1
            and half & (half - 1) == 0 and q.dtype == k.dtype == q_weight.dtype == k_weight.dtype)
    if fits and use_triton(q, k, q_weight):
        from glm53.kernels.qk_heads_triton import finish_qk_heads_triton

        return finish_qk_heads_triton(q, k, q_weight, k_weight, eps, cos, sin, block, hq, hk)
    return finish_qk_heads_reference(q, k, q_weight, k_weight, eps, cos, sin, block)


def finish_qk_heads_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                              eps: float, cos: torch.Tensor, sin: torch.Tensor, block: int) -> torch.Tensor:
    """The ops in turn (each dispatched: torch on the CPU): norm, rotation, the queries' copy."""
    n, d, hq, hk = _check(q, k, q_weight, k_weight, cos, block)
    # heads as rows of one 2-D tensor (a copy where the rows are strided): what the norm takes
    qh = rms_norm(q.reshape(n * hq, d), q_weight, eps).view(n, hq, d)
    qh = apply_rope(qh, cos, sin, interleave=False)
    kh = rms_norm(k.reshape(n * hk, d), k_weight, eps).view(n, hk, d)
    k.view(n, hk, d).copy_(apply_rope(kh, cos, sin, interleave=False))
    r, g = n // block, hq // hk
    return qh.view(r, block, hk, g, d).permute(0, 2, 3, 1, 4).reshape(r, hk, g * block, d)


def store_context_kv(x: torch.Tensor, k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     out_slots: torch.Tensor, inv_freq: torch.Tensor, pool: torch.Tensor) -> None:
    """x [N, L, 2, KV, D]: each context row's K then V heads of the L draft layers (rows may be
    strided); k_weight [L, D] (each layer's k_norm); positions / out_slots [N] long; inv_freq
    [D/2] fp32; pool [pages, 2·KV, L, page_size, D] (heads K0 V0 K1 V1 …). Writes RoPE(RMSNorm(K))
    and V of row t, layer l, head h at pool[slot // page_size, 2h / 2h + 1, l, slot % page_size]."""
    n, nl, two, kv, d = x.shape
    if two != 2 or k_weight.shape != (nl, d) or pool.shape[1:3] != (2 * kv, nl) or pool.shape[4] != d:
        raise ValueError(f"x {tuple(x.shape)}, k_weight {tuple(k_weight.shape)}, pool {tuple(pool.shape)} do not fit")
    half = d // 2
    fits = (x.stride()[1:] == (2 * kv * d, kv * d, d, 1) and k_weight.is_contiguous() and pool.stride(-1) == 1
            and half & (half - 1) == 0 and x.dtype == k_weight.dtype == pool.dtype)
    if fits and use_triton(x, pool):
        from glm53.kernels.qk_heads_triton import store_context_kv_triton

        return store_context_kv_triton(x, k_weight, eps, positions, out_slots, inv_freq, pool)
    store_context_kv_reference(x, k_weight, eps, positions, out_slots, inv_freq, pool)


def store_context_kv_reference(x: torch.Tensor, k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                               out_slots: torch.Tensor, inv_freq: torch.Tensor, pool: torch.Tensor) -> None:
    """The ops in turn: all layers' K normed at once (torch's reduction: the weight is per layer),
    rotated, stacked with V in the pool's head order, and stored at the slots."""
    n, nl, _, kv, d = x.shape
    cos, sin = rope_cos_sin(positions, inv_freq)
    k = rms_norm(x[:, :, 0], k_weight[:, None, :], eps)  # [n, L, kv, d]
    k = apply_rope(k.reshape(n, nl * kv, d), cos, sin, interleave=False).view(n, nl, kv, d)
    # pool heads interleave K and V per KV head: [n, L, kv, 2, d] -> [n, 2·kv, L, d]
    vals = torch.stack([k, x[:, :, 1]], dim=3).permute(0, 2, 3, 1, 4).reshape(n, 2 * kv, nl, d)
    ps = pool.shape[3]
    pool.permute(0, 3, 1, 2, 4)[out_slots // ps, out_slots % ps] = vals.to(pool.dtype)

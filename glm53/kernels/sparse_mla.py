"""Sparse MLA in the absorbed (MQA) form over the paged latent cache.

out[t, h] = Σ_j softmax_j(q[t, h] · kv[s_j] · sm_scale) · kv[s_j, :kv_lora_rank]
over the selected slots s_j = indices[t, j] (−1 = none).

- `q` [T, H, R + P]: absorbed queries (q_nope·W_UK | rotated q_pe), in the cache's order;
- `kv_cache` [num_pages, page_size, R + P]: one layer's view of the page-major latent pool, or
  the FP8 cache [num_pages, page_size, bytes_per_token] uint8 (`latent_cache_fp8`, 656 B/token for
  GLM-5): the selected rows are dequantized after they are gathered (the reference gathers then
  dequantizes; the Triton kernel dequantizes in registers, the Hopper one `sparse_mla_fp8_hopper`
  into shared memory), never the whole pool;
- `indices` [T, K] int32 physical slots (page * page_size + offset);
- returns [T, H, R] in q's dtype (accumulation in fp32). A row with no valid slot gives zeros.
"""

from __future__ import annotations

import torch

from glm53.kernels import latent_cache_fp8
from glm53.kernels.dispatch import triton_interpreting, use_triton


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows cache[slot // page_size, slot % page_size] of a [pages, page_size, D] layer view of a
    page-major pool, [*slots.shape, D]: one `index_select` over the view's token rows, which
    are evenly strided when the page stride is a whole number of row strides (the pools' layout),
    instead of a two-index gather (half the time on a CPU); the two-index gather otherwise."""
    ps, (sp, so, sd) = cache.shape[1], cache.stride()
    if sd != 1 or so <= 0 or sp % so:
        return cache[slots // ps, slots % ps]
    per_page = sp // so
    rows = torch.as_strided(cache, ((cache.shape[0] - 1) * per_page + ps, cache.shape[2]), (so, 1),
                            cache.storage_offset())
    return rows.index_select(0, ((slots // ps) * per_page + slots % ps).flatten()).view(*slots.shape, -1)


def sparse_mla_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, kv_lora_rank: int
) -> torch.Tensor:
    T, H, Dqk = q.shape
    K = indices.shape[1]
    fp8 = kv_cache.dtype == torch.uint8
    layout = latent_cache_fp8.LatentLayout(kv_lora_rank, Dqk - kv_lora_rank) if fp8 else None
    out = torch.empty((T, H, kv_lora_rank), dtype=q.dtype, device=q.device)
    chunk = max(1, (1 << 24) // max(1, K * Dqk))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        idx = indices[t0:t1].to(torch.long)
        valid = idx >= 0
        idx = idx.clamp_min(0)
        if fp8:  # only the selected rows: [t, K, bytes_per_token] -> fp32 [t, K, R+P]
            kv = latent_cache_fp8.gather(kv_cache, idx, layout)
        else:
            kv = gather_slots(kv_cache, idx).float()  # [t, K, R+P]
        scores = torch.einsum("thd,tkd->thk", q[t0:t1].float(), kv) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # all-masked row -> zeros
        out[t0:t1] = torch.einsum("thk,tkr->thr", probs, kv[..., :kv_lora_rank]).to(q.dtype)
    return out


def sparse_mla(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, kv_lora_rank: int,
    keep_splits: bool = False,
):
    """`keep_splits`: a Triton kernel that splits the slots may leave its splits uncombined
    (`sparse_mla_triton.Splits`, for the W_UV product to take); the reference returns the output."""
    if use_triton(q) and kv_cache.dtype == torch.uint8:
        from glm53.kernels.sparse_mla_fp8_hopper import fp8_hopper_supports, sparse_mla_fp8_hopper
        from glm53.kernels.sparse_mla_fp8_triton import sparse_mla_fp8_triton

        if not triton_interpreting() and fp8_hopper_supports(q, kv_cache, kv_lora_rank):  # sm_90, GLM-5 row
            return sparse_mla_fp8_hopper(q, kv_cache, indices, sm_scale, kv_lora_rank, keep_splits=keep_splits)

        return sparse_mla_fp8_triton(q, kv_cache, indices, sm_scale, kv_lora_rank, keep_splits=keep_splits)
    if use_triton(q):
        from glm53.kernels.sparse_mla_triton import sparse_mla_triton

        return sparse_mla_triton(q, kv_cache, indices, sm_scale, kv_lora_rank, keep_splits=keep_splits)
    return sparse_mla_reference(q, kv_cache, indices, sm_scale, kv_lora_rank)

"""DSA indexer logits over the paged indexer-key cache.

logits[t, s] = Σ_h weights[t, h] · ReLU(q[t, h] · k[slot(t, s)])   for s < lengths[t], else -inf

- `q` [T, H, D] (after RoPE), `weights` [T, H] with every scale folded in
  (weights_proj(x) · H^-0.5 · D^-0.5; ReLU commutes with a positive scale);
- `k_cache` [num_pages, page_size, D]: one layer's view of the page-major pool (strided is fine);
- `page_table` [T, max_pages] int32: the page table row of each query token's request;
- `lengths` [T] int32: how many context positions token t may see (causal within a verify block).
"""

from __future__ import annotations

import torch

from glm53.kernels import index_cache_fp8
from glm53.kernels.dispatch import use_triton
from glm53.kernels.rope import apply_rope


def gather_paged(cache: torch.Tensor, page_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` token rows of each page-table row: [R, n, ...] from a [pages, page_size, ...] cache.
    Positions past the table (a width rounded up past the last page, kernels/variants.logits_width)
    read its last page: they lie past every length, so callers mask them."""
    page_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    col = (pos // page_size).clamp_max(page_table.shape[1] - 1)
    pages = page_table.to(torch.long)[:, col].clamp_min(0)
    return cache[pages, (pos % page_size)[None, :]]


def _keys(k_cache: torch.Tensor, k_scales: torch.Tensor | None, page_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` keys of each page-table row, fp32 [R, n, D] (an fp8 cache dequantized with
    its per-token `k_scales`; the bytes are gathered, as indexing fp8 tensors is not implemented
    everywhere, then widened)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        keys = gather_paged(k_cache.view(torch.uint8), page_table, n).view(torch.float8_e4m3fn).float()
        return keys * gather_paged(k_scales, page_table, n)[..., None]
    return gather_paged(k_cache, page_table, n).float()


def row_runs(page_table: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive equal page-table rows: the tokens of one request
    in a prefill chunk or a verify block (reads the table on the host: the CPU path)."""
    t = page_table.shape[0]
    if t == 1:
        return [(0, 1)]
    cuts = ((page_table[1:] != page_table[:-1]).any(dim=1).nonzero().flatten() + 1).tolist()
    return list(zip([0, *cuts], [*cuts, t]))


def indexer_logits_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    k_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`k_scales` [num_pages, page_size] fp32 with an fp8 `k_cache`: each gathered key is
    dequantized (fp8 value × its token's scale) in fp32, only the rows a query can see.

    Tokens that share their request's page table (a prefill chunk, a verify block) read its keys
    gathered once for all of them; a batch of one token per request gathers each token's keys
    in one batch."""
    T, H, D = q.shape
    out = torch.empty((T, max_len), dtype=torch.float32, device=q.device)
    pos = torch.arange(max_len, device=q.device)
    runs = row_runs(page_table)
    if len(runs) == T:
        runs = []  # no row shares its keys: the batched gather below
    for r0, r1 in runs:
        keys = _keys(k_cache, k_scales, page_table[r0 : r0 + 1], max_len)[0]  # [S, D]
        # Bound the [t, H, S] products to ~16M elements per chunk of query tokens.
        chunk = max(1, (1 << 24) // max(1, max_len * H))
        for t0 in range(r0, r1, chunk):
            t1 = min(r1, t0 + chunk)
            dots = torch.matmul(q[t0:t1].float(), keys.T).relu_()  # [t, H, S]
            logit = torch.einsum("th,ths->ts", weights[t0:t1].float(), dots)
            valid = pos[None, :] < lengths[t0:t1].to(torch.long)[:, None]
            out[t0:t1] = logit.masked_fill(~valid, float("-inf"))
    if runs:
        return out
    # Bound the gathered keys to ~16M elements per chunk of query tokens.
    chunk = max(1, (1 << 24) // max(1, max_len * D))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        keys = _keys(k_cache, k_scales, page_table[t0:t1], max_len)  # [t, S, D]
        dots = torch.einsum("thd,tsd->ths", q[t0:t1].float(), keys).relu_()
        logit = torch.einsum("th,ths->ts", weights[t0:t1].float(), dots)
        valid = pos[None, :] < lengths[t0:t1].to(torch.long)[:, None]
        out[t0:t1] = logit.masked_fill(~valid, float("-inf"))
    return out


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
    rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
) -> torch.Tensor:
    """`rope` (cos, sin [T, R/2] fp32, interleave): q's first R columns are taken rotated
    (`rope.apply_rope`'s values; the kernel rotates them as it loads q, the reference rotates q
    first, in place)."""
    half = rope[0].shape[1] if rope is not None else 0
    if use_triton(q) and (rope is None or (half & (half - 1) == 0 and rope[0].stride(-1) == 1)):
        from glm53.kernels.indexer_logits_triton import indexer_logits_triton

        return indexer_logits_triton(q, weights, k_cache, page_table, lengths, max_len, rope=rope)
    if rope is not None:
        cos, sin, interleave = rope
        apply_rope(q[..., : 2 * half], cos, sin, interleave, out=q[..., : 2 * half])
    return indexer_logits_reference(q, weights, k_cache, page_table, lengths, max_len)


# ---- FP8 key cache (132 B/token for D = 128; layout in index_cache_fp8) ----------------------


def indexer_logits_fp8_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache_fp8: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """The same logits over the FP8 cache: the keys each query sees, dequantized (fp8 value ×
    per-token scale) in fp32; never the whole pool."""
    keys, scales = index_cache_fp8.split_view(k_cache_fp8, q.shape[-1])
    return indexer_logits_reference(q.float(), weights, keys, page_table, lengths, max_len, k_scales=scales)


def indexer_logits_fp8(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache_fp8: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    max_len: int,
) -> torch.Tensor:
    """Indexer logits over one layer's FP8 key cache `k_cache_fp8` [num_pages, page_size*(D+4)]
    uint8 (a strided view `pool[:, j]` of a page-major pool). `q` [T, H, D] is bf16, or fp8 e4m3
    with its per-(token, head) scales folded into `weights`."""
    if use_triton(q):
        from glm53.kernels.indexer_logits_triton import indexer_logits_triton

        keys, scales = index_cache_fp8.split_view(k_cache_fp8, q.shape[-1])
        return indexer_logits_triton(q, weights, keys, page_table, lengths, max_len, k_scales=scales)
    return indexer_logits_fp8_reference(q, weights, k_cache_fp8, page_table, lengths, max_len)

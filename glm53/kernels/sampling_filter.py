"""Top-k, top-p and min-p filtering of temperature-scaled logits, per row.

One implementation for the target's sampler (server/sampling.py) and the draft's own
distribution q (models/dspark.py): speculative sampling is lossless whatever q is, but the draft
accepts most when q is filtered exactly as p is, so both read this. Torch only (a sort and a few
elementwise ops per row); the host decides which filters run (`sort`, `use_min_p`), so nothing
here waits for the device.
"""

from __future__ import annotations

import torch


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  sort: bool = True, use_min_p: bool = True) -> torch.Tensor:
    """x [N, V] with the excluded logits set to -inf. Per row: `top_k` (long; V keeps all),
    `top_p` (1 keeps all), `min_p` (0 keeps all). `sort`: some row has top-k < V or top-p < 1;
    `use_min_p`: some row has min-p > 0 (False skips work, never changes the result)."""
    V = x.shape[-1]
    if sort:
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=x.device).unsqueeze(0)
        drop = rank >= top_k.unsqueeze(1)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already reaches top_p. The top token is always kept.
        before = probs.cumsum(dim=-1) - probs
        drop = drop | ((before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1))
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
    if use_min_p:
        probs = torch.softmax(x, dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        x = x.masked_fill(probs < thresh, float("-inf"))
    return x

"""DSA top-k: per row, the positions of the k highest scores inside the row's valid prefix.

Contract (shared by the reference and every fast path):
- `logits` [B, L] float32/bfloat16, `lengths` [B] int32: only positions < lengths[b] are valid;
- the result [B, k] int32 holds the *set* of the k best positions, ties broken by lowest
  position first (so the set equals the first k of a stable descending sort); order within a
  row is free; a row with length < k holds all its positions and -1 in the remaining slots.
Lowest-position tie breaking makes a request's selection independent of what else is in the
batch and of how far its row is padded.
"""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import use_triton


def dsa_topk_reference(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    B, L = logits.shape
    pos = torch.arange(L, device=logits.device)
    valid = pos[None, :] < lengths.to(torch.long)[:, None]
    scores = logits.float().masked_fill(~valid, float("-inf"))
    # A stable sort keeps equal scores in position order: lowest position wins ties.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    kk = min(k, L)
    out = torch.full((B, k), -1, dtype=torch.int32, device=logits.device)
    top = order[:, :kk].to(torch.int32)
    rank = torch.arange(kk, device=logits.device)[None, :]
    out[:, :kk] = torch.where(rank < lengths.to(torch.long)[:, None], top, torch.full_like(top, -1))
    return out


def dsa_topk_select(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """`dsa_topk_reference`'s output exactly (the same positions in the same order), sorting k
    values a row instead of all L (the CPU path for L well above k: 5× faster at L = 1,000, k =
    64): the k-th best score of each row, every position above it and, of the positions equal to
    it, the lowest ones the k still need; then those k in the reference's order (score
    descending, a tie by the lower position first)."""
    B, L = logits.shape
    kk = min(k, L)
    lens = lengths.to(torch.long)[:, None]
    pos = torch.arange(L, device=logits.device)
    scores = logits.float().masked_fill(pos[None] >= lens, float("-inf"))
    out = torch.full((B, k), -1, dtype=torch.int32, device=logits.device)
    if kk == 0 or B == 0:
        return out
    kth = scores.topk(kk, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    chosen = above | (tied & (tied.cumsum(dim=-1) <= kk - above.sum(dim=-1, keepdim=True)))
    top = pos.expand(B, L)[chosen].view(B, kk)  # ascending positions: a stable sort keeps ties so
    top = top.gather(1, torch.sort(scores.gather(1, top), dim=-1, descending=True, stable=True).indices)
    rank = torch.arange(kk, device=logits.device)[None, :]
    out[:, :kk] = torch.where(rank < lens, top, -1).to(torch.int32)
    return out


# Where `dsa_topk` on a CPU selects instead of sorting every row (either gives the same output):
# rows of at least 4k positions, and 8,192 scores in all or 4,096 a row. Measured on a 2-core
# EPYC, one thread, k = 64: the select is 0.5-0.8x the sort's speed at [1, 256..2000] and
# [16, 256], 2.2-5.5x from [16, 512], [4, 2000] and [1, 4000] on.
SELECT_MIN_RATIO, SELECT_MIN_SCORES, SELECT_MIN_ROW = 4, 8192, 4096


def positions_to_slots(positions: torch.Tensor, page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Map token positions [B, k] (-1 = none) to physical cache slots through each row's page
    table [B, max_pages] (slot = page * page_size + offset); -1 stays -1."""
    p = positions.to(torch.long).clamp_min(0)
    pages = torch.gather(page_table.to(torch.long), 1, p // page_size)
    slots = pages * page_size + p % page_size
    return torch.where(positions >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


def dsa_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    if use_triton(logits):
        from glm53.kernels.topk_triton import topk_triton

        return topk_triton(logits, lengths, k)
    return _topk_cpu(logits, lengths, k)


def _topk_cpu(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The reference's values either way; the select where it is the faster (see above)."""
    B, L = logits.shape
    if L >= SELECT_MIN_RATIO * k and (B * L >= SELECT_MIN_SCORES or L >= SELECT_MIN_ROW):
        return dsa_topk_select(logits, lengths, k)
    return dsa_topk_reference(logits, lengths, k)


def dsa_topk_paged(
    logits: torch.Tensor, lengths: torch.Tensor, k: int, page_table: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Top-k fused with the page-table gather: returns physical slot ids (what sparse MLA reads)."""
    if use_triton(logits):
        from glm53.kernels.topk_triton import topk_triton

        return topk_triton(logits, lengths, k, page_table=page_table, page_size=page_size)
    return positions_to_slots(_topk_cpu(logits, lengths, k), page_table, page_size)

"""The speculative step's per-row derivations, one launch each: the draft's inputs, the padded
verify batch, and the rows' advance to the next step.

A speculative step (models/spec_state.py, spec_graph.py) derives everything from a static state:
per request its row [last token, start, ctx_start, n, end] and its page-table row. In torch ops
that is ~10 launches for the draft's inputs (ids, positions, pages, the key mask) and four more
for the draft's RoPE, ~15 for the verify batch and six more in the model (slots split into (page,
offset), the target's RoPE), and ~18 for the advance: on a GPU each is a few µs of a graph replay
with almost nothing to do, ~50 a step, where the plain decode step does its own in one
(`step_inputs`). `spec_inputs_triton` computes each group in one kernel. Integer results are the
ops' exactly; cos/sin are libdevice's cosf/sinf of the same fp32 product, which is what torch's
CUDA ops compute (`step_inputs`), so the results equal the ops' bit for bit.

The references below are the ops themselves (the CPU path, and any shape a kernel does not take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.kernels.dispatch import use_triton
from glm53.kernels.rope import rope_cos_sin


@dataclass
class DraftInputs:
    ids: torch.Tensor  # [bs, K] long: [last, MASK × (K − 1)]
    positions: torch.Tensor  # [bs·K] long: start + j
    table: torch.Tensor  # [bs, width] long: the context pages, −1 → the padding page
    mask: torch.Tensor  # [bs, width·page_size + K] bool
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos/sin [bs·K, D/2] fp32 of `positions`


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [bs·K] long
    positions: torch.Tensor  # [bs·K] long
    out_slots: torch.Tensor  # [bs·K] long
    page_table: torch.Tensor  # [bs·K, width] int32
    context_lens: torch.Tensor  # [bs·K] int32
    page: torch.Tensor  # [bs·K] long: out_slots // page_size
    offset: torch.Tensor  # [bs·K] long: out_slots % page_size
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos/sin [bs·K, D/2] fp32 of `positions`
    n: torch.Tensor  # [bs] long: the tokens each row verifies (its n, capped by a cut's keep + 1)


def _pow2(half: int | None) -> bool:
    return half is None or half & (half - 1) == 0


# ---- the draft's inputs --------------------------------------------------------------------------
def draft_inputs(rows: torch.Tensor, page_table: torch.Tensor, width: int, page_size: int, pad_page: int,
                 mask_token_id: int, j: torch.Tensor, ctx_pos: torch.Tensor,
                 inv_freq: torch.Tensor | None = None) -> DraftInputs:
    """rows [bs, 5] long (last, start, ctx_start, n, end); page_table [bs, ≥ width] int32 (−1: no
    page); j = arange(K), ctx_pos = arange(≥ width·page_size) on the device (the reference's
    constants: a graph would otherwise replay an arange). The block [last, MASK…] at start + j,
    the context pages, and the key mask: context positions in [ctx_start, start), block positions
    j < n. With `inv_freq` [D/2] also the positions' cos/sin."""
    if use_triton(rows, page_table) and _pow2(None if inv_freq is None else inv_freq.shape[0]) \
            and page_table.stride(1) == 1 and rows.is_contiguous():
        from glm53.kernels.spec_inputs_triton import draft_inputs_triton

        return DraftInputs(*draft_inputs_triton(rows, page_table, width, page_size, pad_page, mask_token_id,
                                                    j.shape[0], inv_freq))
    return draft_inputs_reference(rows, page_table, width, page_size, pad_page, mask_token_id, j, ctx_pos, inv_freq)


def draft_inputs_reference(rows: torch.Tensor, page_table: torch.Tensor, width: int, page_size: int, pad_page: int,
                           mask_token_id: int, j: torch.Tensor, ctx_pos: torch.Tensor,
                           inv_freq: torch.Tensor | None = None) -> DraftInputs:
    last, start, ctx0, n, _ = rows.unbind(1)
    bs, k = rows.shape[0], j.shape[0]
    ids = torch.cat([last[:, None], last.new_full((bs, k - 1), mask_token_id)], dim=1)
    positions = (start[:, None] + j).reshape(-1)
    table = page_table[:, :width].to(torch.long)
    table = torch.where(table < 0, pad_page, table)
    pos = ctx_pos[: width * page_size]
    ctx_mask = (pos >= ctx0[:, None]) & (pos < start[:, None])
    rope = None if inv_freq is None else rope_cos_sin(positions, inv_freq)
    return DraftInputs(ids, positions, table, torch.cat([ctx_mask, j < n[:, None]], dim=1), rope)


# ---- the padded verify batch ---------------------------------------------------------------------
def padded_batch(ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor], start: torch.Tensor, n: torch.Tensor,
                 table: torch.Tensor, pad_row: torch.Tensor, width: int, page_size: int, j: torch.Tensor,
                 inv_freq: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> PaddedBatch:
    """A static batch of bs rows of K tokens, flattened to bs·K: `ids` [bs, K], or (first [bs],
    rest [bs, K − 1]) meaning their concatenation; row i's token j < n[i] at position start[i] + j
    in its pages (`table` [bs, ≥ width] int32), token j ≥ n[i] a padding token (position 0 on the
    padding page, `pad_row` [≥ width] int32), so nothing outside a request's pages is read or
    written. `j` = arange(≥ K) on the device. With `inv_freq` also the positions' cos/sin. `keep`
    [bs] long (a DSpark cut's kept proposals): n[i] becomes min(n[i], keep[i] + 1) first, in the
    same launch (the batch's `n`)."""
    k = ids.shape[1] if isinstance(ids, torch.Tensor) else ids[1].shape[1] + 1
    parts = (ids,) if isinstance(ids, torch.Tensor) else ids
    if use_triton(start, n, table) and _pow2(None if inv_freq is None else inv_freq.shape[0]) \
            and table.stride(1) == 1 and pad_row.stride(0) == 1 and parts[-1].stride(-1) == 1:
        from glm53.kernels.spec_inputs_triton import padded_batch_triton

        return PaddedBatch(*padded_batch_triton(parts, start, n, table, pad_row, width, page_size, k, inv_freq, keep))
    return padded_batch_reference(ids, start, n, table, pad_row, width, page_size, j, inv_freq, keep)


def padded_batch_reference(ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor], start: torch.Tensor,
                           n: torch.Tensor, table: torch.Tensor, pad_row: torch.Tensor, width: int, page_size: int,
                           j: torch.Tensor, inv_freq: torch.Tensor | None = None,
                           keep: torch.Tensor | None = None) -> PaddedBatch:
    if keep is not None:
        n = torch.minimum(n, keep + 1)
    if not isinstance(ids, torch.Tensor):
        ids = torch.cat([ids[0][:, None], ids[1]], dim=1)
    bs, k = ids.shape
    ps = page_size
    j = j[:k]
    valid = j < n[:, None]  # [bs, K]
    pos = torch.where(valid, start[:, None] + j, 0).reshape(-1)
    rows = torch.where(valid[..., None], table[:, None, :width], pad_row[:width]).reshape(bs * k, width)
    page = rows.gather(1, (pos // ps)[:, None]).squeeze(1).to(torch.long)
    slots = page * ps + pos % ps
    rope = None if inv_freq is None else rope_cos_sin(pos, inv_freq)
    return PaddedBatch(ids.reshape(-1), pos, slots, rows, (pos + 1).to(torch.int32), slots // ps, slots % ps, rope, n)


# ---- the rows' advance ---------------------------------------------------------------------------
def advance_rows(rows: torch.Tensor, tokens: torch.Tensor, j: torch.Tensor) -> None:
    """Moves `rows` [bs, 5] in place past the step whose output is `tokens` [bs, 2K] (the K − 1
    drafts, the K verify argmaxes, the count verified), as greedy acceptance moves them: start
    past the accepted drafts and the target's token, which becomes the last token, n = min(K,
    end − start − 1); a row with no token left to verify stays. `j` = arange(≥ K − 1)."""
    if use_triton(rows, tokens) and rows.is_contiguous() and tokens.is_contiguous():
        from glm53.kernels.spec_inputs_triton import advance_rows_triton

        return advance_rows_triton(rows, tokens)
    return advance_rows_reference(rows, tokens, j)


def advance_rows_reference(rows: torch.Tensor, tokens: torch.Tensor, j: torch.Tensor) -> None:
    k = tokens.shape[1] // 2
    last, start, ctx0, n, end = rows.unbind(1)
    drafts, target, verified = tokens[:, : k - 1], tokens[:, k - 1 : 2 * k - 1], tokens[:, 2 * k - 1]
    match = (drafts == target[:, : k - 1]) & (j[: k - 1] < (verified - 1)[:, None])
    accepted = match.cumprod(dim=1).sum(dim=1)
    nxt = start + accepted + 1
    left = end - nxt - 1  # tokens the next step may verify
    live = left > 0
    new = torch.stack([torch.where(live, target.gather(1, accepted[:, None]).squeeze(1), last),
                       torch.where(live, nxt, start), ctx0,
                       torch.where(live, left.clamp(max=k), n), end], dim=1)
    rows.copy_(new)

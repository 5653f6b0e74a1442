"""Device-resident batch state of the DFlash step (propose + verify), for CUDA graphs.

A DFlash step at verify width K (the instance's block, the bonus slot included) takes, per
request, its last committed token at position `start`, the first position whose draft context
exists (`ctx_start`) and how many tokens it verifies, n ≤ K (fewer near max_new_tokens). The draft
proposes from [last, MASK × (K − 1)] at positions start .. start + K − 1 over the draft context of
[ctx_start, start); the target verifies [last, d_1 .. d_{n−1}] at start .. start + n − 1.

Static buffers of `max_bs` rows (models/decode_state.py does the same for plain decode):
- `rows` [max_bs, 5] long: last token, start, ctx_start, n, end (positions stop before it: prompt
  + max_new_tokens). Every request's start moves by what it accepted: the host sends the active
  rows in one small pinned, non-blocking copy (rows that left go back to the padding request in
  the same copy), or, for an overlapped step, `advance` moves them on the device from the step
  before it (greedy acceptance, the host's rule for n);
- `page_table` [max_bs, max_pages] int32, a row rewritten only when its pages change (host mirror).
The padding request: last token 0, start 0, ctx_start 0, n 1, end 1, pages [pad_page]; everything
it writes lands on the reserved padding page, and `advance` leaves it where it is.

At a fixed (batch size, width) everything else is derived on the device, so a CUDA graph captured
on it replays correctly for any contents:
- `draft_inputs`: the block ids and positions, the context pages (−1 → the padding page: masked)
  and the key mask [bs, width·page_size + K]: context positions in [ctx_start, start), block
  positions j < n. Masking the block's tail makes a request that verifies n < K tokens draft
  exactly the block of n the eager path drafts (the block attends to itself non-causally);
- `verify_batch`: the flattened bs·K verify tokens; token j < n of a row at start + j in the row's
  pages, token j ≥ n a padding token (position 0 on the padding page), so nothing outside a
  request's pages is read or written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm53.kernels import spec_inputs
from glm53.kernels.spec_inputs import DraftInputs
from glm53.models.model import ForwardBatch

PAD = (0, 0, 0, 1, 1)  # the padding request's row: last token 0, start 0, ctx_start 0, n 1, end 1


@dataclass(frozen=True)
class StepRow:
    """One request of a step, as host ints (a `DraftBlock` with its verify width resolved).
    `end`: the position the request's tokens stop before (prompt + max_new_tokens; None: start +
    n, i.e. no step after this one)."""

    last_token: int
    start: int
    ctx_start: int
    n: int
    pages: tuple[int, ...]
    end: int | None = None

    @property
    def stop(self) -> int:
        return self.start + self.n if self.end is None else self.end


class SpecState:
    def __init__(self, max_bs: int, max_pages: int, page_size: int, pad_page: int, block: int, mask_token_id: int,
                 max_position: int, device: torch.device | str = "cpu"):
        if max_bs < 1 or max_pages < 1:
            raise ValueError(f"max_bs and max_pages must be >= 1, got {max_bs}, {max_pages}")
        if block < 2:
            raise ValueError(f"the verify width must be >= 2 (the bonus slot and a draft), got {block}")
        self.max_bs, self.max_pages, self.page_size, self.k = max_bs, max_pages, page_size, block
        self.pad_page, self.max_position = pad_page, max_position
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        dev = self.device
        self.rows = torch.tensor([PAD] * max_bs, dtype=torch.long, device=dev)
        self.page_table = torch.full((max_bs, max_pages), -1, dtype=torch.int32, device=dev)
        self.page_table[:, 0] = pad_page
        # Constants of the derivations, made once (a graph must not copy from the host).
        self._j = torch.arange(block, device=dev)
        self._ctx_pos = torch.arange(max_pages * page_size, device=dev)
        self.mask_token_id = mask_token_id
        self._pad_row = self.page_table[0].clone()
        self._mirror: list[tuple[int, ...] | None] = [None] * max_bs  # pages per row; None: padding
        self.active = 0
        self.rows_written = 0  # page-table rows rewritten so far (joins, leaves, moves; not steps)

    def check(self, rows: Sequence[StepRow]) -> None:
        """What the eager step checks (host ints only): a ValueError for rows it cannot hold."""
        if not 0 < len(rows) <= self.max_bs:
            raise ValueError(f"{len(rows)} requests: the state holds 1 .. {self.max_bs}")
        ps = self.page_size
        for r in rows:
            if not 1 <= r.n <= self.k:
                raise ValueError(f"a request verifies 1 .. {self.k} tokens here, got {r.n}")
            if not 0 <= r.ctx_start <= r.start:
                raise ValueError(f"ctx_start {r.ctx_start} must lie in [0, start={r.start}]")
            end = r.start + r.n
            if r.end is not None and r.end < end:
                raise ValueError(f"end {r.end} before start + n = {end}")
            if end > self.max_position:
                raise ValueError(f"position {end - 1} outside [0, {self.max_position})")
            if -(-end // ps) > len(r.pages):
                raise ValueError(f"page table of {len(r.pages)} pages cannot hold {end} tokens (page_size={ps})")
            if len(r.pages) > self.max_pages:
                raise ValueError(f"page table of {len(r.pages)} pages exceeds the state's width {self.max_pages}")

    def update(self, rows: Sequence[StepRow]) -> None:
        """Make rows [0, len(rows)) hold `rows` and every row after them the padding request.
        No host sync: non-blocking copies from pinned memory and device ops only."""
        self.check(rows)
        n = len(rows)
        top = max(n, self.active)
        values = [[r.last_token, r.start, r.ctx_start, r.n, min(r.stop, self.max_position)] for r in rows]
        values += [list(PAD)] * (top - n)
        self.rows[:top].copy_(self._host(values), non_blocking=True)
        changed: list[tuple[int, tuple[int, ...]]] = []
        for i, r in enumerate(rows):
            if self._mirror[i] != r.pages:
                changed.append((i, r.pages))
                self._mirror[i] = r.pages
        for i in range(n, self.active):  # rows that left: back to the padding page
            changed.append((i, (self.pad_page,)))
            self._mirror[i] = None
        if changed:
            self._write_pages(changed)
        self.active = n

    def _host(self, data: list) -> torch.Tensor:
        # Pinned, so the copy is asynchronous; the caching host allocator keeps the block until
        # the copy has run.
        return torch.tensor(data, dtype=torch.long, pin_memory=self._pin)

    def _write_pages(self, changed: list[tuple[int, tuple[int, ...]]]) -> None:
        packed = self._host([[i, *pages, *([-1] * (self.max_pages - len(pages)))] for i, pages in changed])
        packed = packed.to(self.device, non_blocking=True)
        self.page_table.index_copy_(0, packed[:, 0], packed[:, 1:].to(torch.int32))
        self.rows_written += len(changed)

    def width_needed(self, rows: Sequence[StepRow]) -> int:
        """Pages the step reads or writes per request at most: its verify positions' pages."""
        return max(-(-(r.start + r.n) // self.page_size) for r in rows)

    # --- derived on the device (what a graph captures) ------------------------------------
    def _fields(self, bs: int, width: int) -> tuple[torch.Tensor, ...]:
        if not 0 < bs <= self.max_bs or not 0 < width <= self.max_pages:
            raise ValueError(f"batch ({bs}, {width}) outside the state's ({self.max_bs}, {self.max_pages})")
        return self.rows[:bs].unbind(1)

    def draft_inputs(self, bs: int, width: int, inv_freq: torch.Tensor | None = None) -> DraftInputs:
        """With `inv_freq` (the draft's RoPE frequencies) also the block positions' cos/sin."""
        self._fields(bs, width)  # the bounds check
        return spec_inputs.draft_inputs(self.rows[:bs], self.page_table[:bs], width, self.page_size, self.pad_page,
                                        self.mask_token_id, self._j, self._ctx_pos, inv_freq)

    def verify_batch(self, bs: int, width: int, drafts: torch.Tensor, keep: torch.Tensor | None = None,
                     inv_freq: torch.Tensor | None = None) -> tuple[ForwardBatch, torch.Tensor]:
        """The verify forward's batch: bs·K tokens, [last, drafts] per row (`drafts` [bs, K − 1]),
        and the tokens each row verifies [bs]: its n, or with `keep` (the proposals a DSpark cut
        kept) min(n, keep + 1), computed in the batch's own launch (a device tensor, so a cut
        block replays the same graph). With `inv_freq` (the target's RoPE frequencies) the batch
        carries its cos/sin, computed with the rest."""
        last, start, _, rows_n, _ = self._fields(bs, width)
        return padded_batch((last, drafts), start, rows_n, self.page_table[:bs], self._pad_row, width, self.page_size,
                            self._j, inv_freq, keep)

    def advance(self, bs: int, tokens: torch.Tensor) -> None:
        """Move rows [0, bs) to the step after the one whose output is `tokens` [bs, 2K] (the K − 1
        drafts, the K verify argmaxes, the verified count; `spec_graph.spec_forward`), as the
        host would after greedy acceptance: start moves past the accepted drafts and the target's
        token, which becomes the last token, and n = min(K, end − start − 1) (the host's
        min(block, max_new_tokens − output length)). A row with no token left to verify stays
        where it is: the padding request, or a request finished by length, whose step the host
        drops. Device ops only (an overlapped step launches on these rows before the host has
        read this step)."""
        spec_inputs.advance_rows(self.rows[:bs], tokens, self._j)


def padded_batch(ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor], start: torch.Tensor, n: torch.Tensor,
                 table: torch.Tensor, pad_row: torch.Tensor, width: int, page_size: int, j: torch.Tensor,
                 inv_freq: torch.Tensor | None = None, keep: torch.Tensor | None = None
                 ) -> tuple[ForwardBatch, torch.Tensor]:
    """A static batch of bs rows of K tokens (`ids` [bs, K], or (first [bs], rest [bs, K − 1])),
    flattened to bs·K: row i's token j < n[i] at position start[i] + j in its pages (`table` [bs,
    ≥ width] int32), token j ≥ n[i] a padding token (position 0 on the padding page, `pad_row`), so
    nothing outside a request's pages is read or written. `j`: arange(K) on the device, the
    caller's constant. The slots' (page, offset) come with it, and with `inv_freq` the cos/sin
    (`kernels/spec_inputs`: one launch), and the tokens each row verifies (n, capped at `keep` + 1
    when given). Device ops only (CUDA graphs capture it)."""
    pb = spec_inputs.padded_batch(ids, start, n, table, pad_row, width, page_size, j, inv_freq, keep)
    batch = ForwardBatch(input_ids=pb.input_ids, positions=pb.positions, out_slots=pb.out_slots,
                         page_table=pb.page_table, context_lens=pb.context_lens, max_context=width * page_size,
                         rope=pb.rope)
    batch.set_coords(page_size, pb.page, pb.offset)
    return batch, pb.n


@dataclass
class SpecOutput:
    """One DFlash step's result per request: its drafts (n − 1 of them, n the tokens verified:
    fewer than the block when DSpark's confidence cut ended it early), the verify logits
    [n, vocab] fp32, and the argmax of each of those rows when the step computed it on the
    device with the drafts (one device→host copy for both; None: accept derives it). `probs`:
    per request, the draft's q [n − 1, vocab] its drafts were sampled from (None for a request
    whose drafts are the draft's argmax; None overall when no request sampled)."""

    drafts: list[list[int]]
    logits: list[torch.Tensor]
    greedy: list[list[int]] | None = None
    probs: list[torch.Tensor | None] | None = None

"""Decode batch state kept on the device, updated incrementally.

A decode step is one new token per running request. Rebuilding its tensors from Python lists
every step (`ModelRunner.build_batch`) costs host work and blocking host-to-device copies, and
its widths (`max_context`) change every step, so no CUDA graph can hold it. Here the state lives
in static buffers of `max_bs` rows:

- `page_table` [max_bs, max_pages] int32, `positions` [max_bs] long, `input_ids` [max_bs] long;
- a row is written only when its request joins, leaves or moves (its pages or its position are
  not what the row holds); every step first advances the positions of the rows that were active
  on the device (+1), which is exactly what a request that decoded one token needs;
- the new tokens travel in one small pinned, non-blocking copy per step (the sampler on the host
  decides them), changed rows in one more; tokens the previous step sampled on the device
  (`runner.DeviceTokens`) are copied there instead, and with every row's so, nothing crosses;
- rows past the active ones hold a padding request: position 0 on the reserved padding page
  `pad_page`, so a padded batch writes its dummy KV there and nowhere else.

`batch(bs, width)` derives the out slots and context lengths from these buffers with device ops
only, at a fixed page-table width (`max_context = width * page_size`), so a CUDA graph captured on
it replays correctly for any contents. The host mirror (`_rows`) is what decides which rows
changed; it is compared with the step's chunks in Python (list equality, no device reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm53.kernels.step_inputs import step_inputs
from glm53.models.model import ForwardBatch


@dataclass
class _Row:
    pages: list[int]
    pos: int  # the position the device buffer holds for this row


class DecodeState:
    def __init__(self, max_bs: int, max_pages: int, page_size: int, pad_page: int, max_position: int,
                 device: torch.device | str = "cpu"):
        if max_bs < 1 or max_pages < 1:
            raise ValueError(f"max_bs and max_pages must be >= 1, got {max_bs}, {max_pages}")
        self.max_bs, self.max_pages, self.page_size = max_bs, max_pages, page_size
        self.pad_page, self.max_position = pad_page, max_position
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self.page_table = torch.full((max_bs, max_pages), -1, dtype=torch.int32, device=self.device)
        self.page_table[:, 0] = pad_page
        self._rows: list[_Row | None] = [None] * max_bs  # None: the padding request
        self.active = 0
        self.rows_written = 0  # rows rewritten so far (tests and stats: joins/leaves, not steps)

    def _host(self, data: list) -> torch.Tensor:
        # Pinned, so the copy below is asynchronous; the caching host allocator keeps the block
        # until that copy has run, so reusing it is safe.
        return torch.tensor(data, dtype=torch.long, pin_memory=self._pin)

    def check(self, chunks: Sequence) -> None:
        """The build_batch checks for decode chunks (host ints only)."""
        if len(chunks) > self.max_bs:
            raise ValueError(f"{len(chunks)} requests exceed the state's {self.max_bs} rows")
        ps = self.page_size
        for c in chunks:
            if len(c.token_ids) != 1 or c.all_logits:
                raise ValueError("the decode state holds one new token per request (no verify blocks)")
            end = c.start_pos + 1
            if c.start_pos < 0 or end > self.max_position:
                raise ValueError(f"position {c.start_pos} outside [0, {self.max_position})")
            if -(-end // ps) > len(c.page_table):
                raise ValueError(f"page table of {len(c.page_table)} pages cannot hold {end} tokens (page_size={ps})")
            if len(c.page_table) > self.max_pages:
                raise ValueError(f"page table of {len(c.page_table)} pages exceeds the state's width {self.max_pages}")

    def update(self, chunks: Sequence, tokens=None) -> None:
        """Make rows [0, len(chunks)) hold `chunks` (SeqChunks of one token each) and every row
        after them the padding request. `tokens` (runner.DeviceTokens): the input ids of some
        rows are on the device (the previous step's samples). No host sync: device ops and
        non-blocking copies only."""
        self.check(chunks)
        n = len(chunks)
        if self.active:
            self.positions[: self.active] += 1
            for r in self._rows[: self.active]:
                r.pos += 1
        changed: list[tuple[int, int, list[int]]] = []
        for i, c in enumerate(chunks):
            r = self._rows[i]
            if r is None or r.pos != c.start_pos or r.pages != c.page_table:
                pages = list(c.page_table)
                changed.append((i, c.start_pos, pages))
                self._rows[i] = _Row(pages, c.start_pos)
        for i in range(n, self.active):  # rows that left: back to padding
            changed.append((i, 0, [self.pad_page]))
            self._rows[i] = None
        if changed:
            self._write_rows(changed)
        self.active = n
        if n and not (tokens is not None and tokens.covers(n)):  # some tokens come from the host
            self.input_ids[:n].copy_(self._host([c.token_ids[0] for c in chunks]), non_blocking=True)
        if tokens is not None:
            tokens.put(self.input_ids)

    def _write_rows(self, changed: list[tuple[int, int, list[int]]]) -> None:
        w = max(len(p) for _, _, p in changed)
        packed = self._host([[i, pos, *pages, *([-1] * (w - len(pages)))] for i, pos, pages in changed])
        packed = packed.to(self.device, non_blocking=True)
        rows = packed[:, 0]
        self.positions.index_copy_(0, rows, packed[:, 1])
        table = torch.full((len(changed), self.max_pages), -1, dtype=torch.int32, device=self.device)
        table[:, :w] = packed[:, 2:]
        self.page_table.index_copy_(0, rows, table)
        self.rows_written += len(changed)

    def batch(self, bs: int, width: int, inv_freq: torch.Tensor) -> ForwardBatch:
        """The first `bs` rows (active ones, then padding) at page-table width `width`: every
        tensor a view of, or computed on the device from, the static buffers; with them the
        positions' cos/sin under the model's RoPE frequencies `inv_freq`. The slots, their (page,
        offset), the context lengths and cos/sin come from one op (`kernels/step_inputs`)."""
        if not 0 < bs <= self.max_bs or not 0 < width <= self.max_pages:
            raise ValueError(f"batch ({bs}, {width}) outside the state's ({self.max_bs}, {self.max_pages})")
        ps = self.page_size
        pos = self.positions[:bs]
        table = self.page_table[:bs, :width]
        got = step_inputs(pos, table, ps, inv_freq)
        batch = ForwardBatch(input_ids=self.input_ids[:bs], positions=pos, out_slots=got.out_slots, page_table=table,
                             context_lens=got.context_lens, max_context=width * ps, rope=(got.cos, got.sin))
        batch.set_coords(ps, got.page, got.offset)
        return batch

"""Device-resident batch state of the MTP (NextN) draft's decode step, for CUDA graphs.

The eager step (`ModelRunner._mtp_step`, models/mtp.py "Decode") feeds the MTP's catch-up rows
from the verify hidden rows the runner keeps per request in a host dict, builds every batch from
Python lists and truncates to the rows that draft. Here everything a step reads lies in static
buffers of `max_bs` rows at verify width K (the bonus slot and S = K − 1 proposals), so one
captured graph replays any batch of its (batch size, width) bucket:

- the verify half is a `SpecState` (models/spec_state.py): last token, start, n (the tokens a
  request verifies: its proposals + 1, or 1 when it drafts nothing) and the page table;
- `ints` [max_bs, 4 + K] long: c (catch-up rows, 0 .. K; 0: no drafting), the row's hidden slot,
  whether it samples, its top-k, then the c next tokens of its catch-up rows;
- `floats` [max_bs, 3 + S] fp64: temperature, top-p, min-p and the S uniforms of a sampled row;
- `hidden` [max_bs + 1, K, H]: per slot the target's final-normed verify rows of the request
  holding it (slot max_bs: the padding request's). The host gives each request a slot and keeps
  it while the request stays in the batch, so the graph reads the previous verify's rows in place
  and writes the new ones back to the same slot (no host dict lookup inside the graph).

A request's catch-up covers positions start − c .. start − 1 (what the last verify committed, or
the prompt's last position from prefill's seed), padded to K rows; its chained row k (1 .. S − 1)
sits at start + k − 1 while k < its proposals. Padding rows (catch-up rows ≥ c, chained rows past
a request's proposals, every row of the padding request) are position 0 on the padding page:
their MTP and target KV land there only, and every row's result depends on its own inputs only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm53.models.dspark import BlockSampling
from glm53.models.model import ForwardBatch
from glm53.models.spec_state import SpecState, StepRow

NO_TOP_K = 1 << 62  # the top-k of a row that keeps every token (as DFlashDraft.block_sampling)


@dataclass(frozen=True)
class RowSampling:
    """A sampled request's filters and its uniforms (host values, as `block_sampling` draws them)."""

    temperature: float
    top_k: int  # NO_TOP_K: none
    top_p: float
    min_p: float
    uniforms: tuple[float, ...]


@dataclass(frozen=True)
class MTPRow:
    """One request of a static MTP step, as host ints."""

    last_token: int
    start: int
    proposals: int  # 0 .. S: drafted only when `catch` is non-empty
    catch: tuple[int, ...]  # the next tokens of its catch-up rows (positions start − len .. start − 1)
    pages: tuple[int, ...]
    slot: int = -1  # its rows in `hidden` (assigned by the host before the update)
    sampling: RowSampling | None = None

    @property
    def n(self) -> int:
        """Tokens it verifies: [last, proposals...], or [last] alone when it drafts nothing."""
        return self.proposals + 1 if self.catch and self.proposals else 1


class MTPState:
    def __init__(self, max_bs: int, max_pages: int, page_size: int, pad_page: int, block: int, hidden_size: int,
                 dtype: torch.dtype, max_position: int, device: torch.device | str = "cpu"):
        # mask token: the SpecState's draft inputs are DFlash's, unused here
        self.spec = SpecState(max_bs, max_pages, page_size, pad_page, block, 0, max_position, device)
        self.max_bs, self.k, self.s, self.page_size, self.pad_page = max_bs, block, block - 1, page_size, pad_page
        self.device = self.spec.device
        dev = self.device
        self.ints = torch.zeros(max_bs, 4 + block, dtype=torch.long, device=dev)
        self.floats = torch.zeros(max_bs, 3 + self.s, dtype=torch.float64, device=dev)
        self.hidden = torch.zeros(max_bs + 1, block, hidden_size, dtype=dtype, device=dev)
        self.pad_slot = max_bs
        self._ints_pad = [0, max_bs, 0, NO_TOP_K] + [0] * block
        self._floats_pad = [1.0, 1.0, 0.0] + [0.0] * self.s
        self.ints.copy_(torch.tensor([self._ints_pad] * max_bs))
        self.floats.copy_(torch.tensor([self._floats_pad] * max_bs, dtype=torch.float64))
        self._j = torch.arange(block, device=dev)
        self._pad_row = self.spec.page_table[0].clone()  # [pad_page, -1, ...]
        self.active = 0

    def step_rows(self, rows: Sequence[MTPRow]) -> list[StepRow]:
        return [StepRow(r.last_token, r.start, 0, r.n, r.pages) for r in rows]

    def check(self, rows: Sequence[MTPRow]) -> None:
        """What the state cannot hold, as a ValueError (host ints only)."""
        self.spec.check(self.step_rows(rows))
        for r in rows:
            if len(r.catch) > self.k or len(r.catch) > r.start or not 0 <= r.proposals <= self.s:
                raise ValueError(f"catch-up of {len(r.catch)} rows before {r.start}, {r.proposals} proposals: the "
                                 f"state holds at most {self.k} rows and {self.s} proposals")

    def update(self, rows: Sequence[MTPRow]) -> None:
        """Rows [0, len(rows)) hold `rows`, every later one the padding request. No host sync
        (pinned non-blocking copies)."""
        self.check(rows)
        if any(not 0 <= r.slot < self.max_bs for r in rows):
            raise ValueError("every row needs a hidden slot in [0, max_bs)")
        self.spec.update(self.step_rows(rows))
        n = len(rows)
        top = max(n, self.active)
        ints, floats = [], []
        for r in rows:
            s = r.sampling
            ints.append([len(r.catch), r.slot, s is not None, s.top_k if s else NO_TOP_K,
                         *r.catch, *([0] * (self.k - len(r.catch)))])
            u = list(s.uniforms) if s else []
            floats.append([s.temperature, s.top_p, s.min_p] if s else self._floats_pad[:3])
            floats[-1] += u + [0.0] * (self.s - len(u))
        ints += [self._ints_pad] * (top - n)
        floats += [self._floats_pad] * (top - n)
        pin = self.device.type == "cuda"
        self.ints[:top].copy_(torch.tensor(ints, dtype=torch.long, pin_memory=pin), non_blocking=True)
        self.floats[:top].copy_(torch.tensor(floats, dtype=torch.float64, pin_memory=pin), non_blocking=True)
        self.active = n

    def width_needed(self, rows: Sequence[MTPRow]) -> int:
        return self.spec.width_needed(self.step_rows(rows))

    # --- derived on the device (what a graph captures) ------------------------------------
    def _batch(self, bs: int, width: int, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> ForwardBatch:
        """Rows [bs, m] of the requests' tokens `ids` at `pos` where `valid`, else padding rows
        (position 0 on the padding page)."""
        ps, m = self.page_size, pos.shape[1]
        pos = torch.where(valid, pos, 0).reshape(-1)
        table = torch.where(valid[..., None], self.spec.page_table[:bs, None, :width], self._pad_row[:width])
        table = table.reshape(bs * m, width)
        page = table.gather(1, (pos // ps)[:, None]).squeeze(1).to(torch.long)
        return ForwardBatch(input_ids=ids.reshape(-1), positions=pos, out_slots=page * ps + pos % ps,
                            page_table=table, context_lens=(pos + 1).to(torch.int32), max_context=width * ps)

    def catch_up(self, bs: int, width: int) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """The catch-up rows [bs·K]: (batch, target hidden rows [bs·K, H], the flat index [bs] of
        each request's last catch-up row, whose output makes its first proposal)."""
        c, slot = self.ints[:bs, 0], self.ints[:bs, 1]
        start = self.spec.rows[:bs, 1]
        valid = self._j < c[:, None]
        batch = self._batch(bs, width, self.ints[:bs, 4:], start[:, None] - c[:, None] + self._j, valid)
        hidden = self.hidden.index_select(0, slot).reshape(bs * self.k, -1)
        last = torch.arange(bs, device=self.device) * self.k + (c - 1).clamp_min(0)
        return batch, hidden, last

    def chained(self, bs: int, width: int, k: int, tokens: torch.Tensor) -> ForwardBatch:
        """Chained row k (1 .. S − 1) of each request: proposal k at start + k − 1, real while the
        request wants more than k proposals and drafts at all."""
        c, start, n = self.ints[:bs, 0], self.spec.rows[:bs, 1], self.spec.rows[:bs, 3]
        valid = (c > 0) & (n > k + 1)  # n − 1 proposals wanted
        return self._batch(bs, width, tokens[:, None], (start + k - 1)[:, None], valid[:, None])

    def verify_batch(self, bs: int, width: int, drafts: torch.Tensor) -> ForwardBatch:
        return self.spec.verify_batch(bs, width, drafts)[0]

    def verify_n(self, bs: int) -> torch.Tensor:
        return self.spec.rows[:bs, 3]

    def sampling(self, bs: int) -> BlockSampling:
        """The rows' sampling as `sampled_proposal` reads it; both filters always on (with a
        row's neutral values they change nothing), so one graph serves every filter mix."""
        i, f = self.ints[:bs], self.floats[:bs]
        return BlockSampling(rows=i[:, 2].bool(), temperature=f[:, 0].float(), top_k=i[:, 3], top_p=f[:, 1].float(),
                             min_p=f[:, 2].float(), uniforms=f[:, 3:], sort=True, use_min_p=True)

    def keep(self, bs: int, hn: torch.Tensor) -> None:
        """The verify's final-normed rows [bs·K, H] into each request's slot (the next catch-up's)."""
        self.hidden.index_copy_(0, self.ints[:bs, 1], hn.view(bs, self.k, -1).to(self.hidden.dtype))

"""CUDA graphs of the MTP (NextN) draft's decode step: catch-up, chained proposals, verify, the
argmax of every verify row and the verify's hidden rows kept for the next step, one graph per
(batch size, width, sampled) bucket over the static buffers of an `MTPState` (models/mtp_state.py).

Eagerly (`ModelRunner._mtp_step`) a step is three batches built from Python lists, a
device→host copy of the proposals between drafting and verify, and host dict updates of the kept
hidden rows. Here the proposals never leave the device; the host reads the drafts and the verify
argmaxes in one copy afterwards, as for DFlash (models/spec_graph.py, the same bucketing: the
smallest captured batch size and width holding the step, graphs captured largest first into one
memory pool at start-up).

What stays on the host, outside the graph (`MTPSteps`): which rows each request catches up
(`NextNDraft.catch_up`, the eager rule), its hidden slot, and the copy of rows the graph's slot
does not already hold (prefill's seed, or rows an eager step kept); then `NextNDraft.state` is
set as the eager step sets it, its hidden rows views of the slots, so eager and graph steps
interleave freely.

A sampled graph per bucket too: the filters and uniforms are static inputs and both filters
always run (neutral for rows that do not filter), so greedy-only batches keep the cheaper graph
without q. `MTPGraphs.bucket` is the one place that picks graph or eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from glm53.models.draft import DraftBlock
from glm53.models.graph import GraphConfig, batch_buckets, capture_buckets, pick, width_buckets
from glm53.models.mtp_state import NO_TOP_K, MTPRow, MTPState, RowSampling
from glm53.models.readback import readback
from glm53.models.spec_state import SpecOutput

log = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def mtp_forward(runner, state: MTPState, bs: int, width: int, sampled: bool) -> Outputs:
    """The step the graphs hold, device ops only, on the state's first `bs` rows at `width`
    pages: (tokens [bs, S + K + 1] long: the S proposals, the target's argmax of each of the K
    verify rows, the tokens each row verified; verify logits [bs·K, vocab] fp32; with `sampled`,
    q [bs, S, vocab] fp32). Writes the catch-up and chained rows' MTP KV, the verify's target KV
    (padding rows on the padding page) and the verify's final-normed rows into the slots."""
    mtp, model = runner.mtp, runner.model
    batch, hidden, last = state.catch_up(bs, width)
    h = mtp.rows(batch.input_ids, hidden, batch).index_select(0, last)
    s = state.sampling(bs) if sampled else None
    toks, qs = [], []
    for k in range(state.s):
        if k:
            h = mtp.rows(toks[-1], h, state.chained(bs, width, k, toks[-1]))
        tok, q = mtp.sampled_proposal(mtp.head_logits(h), s, k)
        toks.append(tok)
        qs.append(q)
    drafts = torch.stack(toks, dim=1)
    out = model.forward_stage(state.verify_batch(bs, width, drafts), runner.pools, None)
    hn = model.normed_hidden(out)
    logits = model.head(hn)
    state.keep(bs, hn)
    tokens = torch.cat([drafts, logits.argmax(dim=-1).view(bs, state.k), state.verify_n(bs)[:, None]], dim=1)
    return tokens, logits, torch.stack(qs, dim=1) if sampled else None


class MTPSteps:
    """The host side of static MTP steps on one runner: rows from blocks, hidden slots, the
    state update, and the step's result back as the eager step gives it."""

    def __init__(self, runner, max_bs: int, max_pages: int, pad_page: int, block: int):
        mtp = runner.mtp
        self.runner, self.mtp = runner, mtp
        self.state = MTPState(max_bs, max_pages, runner.page_size, pad_page, block, runner.cfg.hidden_size,
                              mtp.dtype, runner.cfg.max_position_embeddings, runner.device)
        self.slots: dict[int, int] = {}  # request key -> hidden slot, while it stays in the batch

    def rows(self, blocks: Sequence[DraftBlock]) -> tuple[list[MTPRow], list] | None:
        """The blocks as state rows (no slots yet) and their catch-up sources, or None when the
        state cannot hold them. Reads the kept state only (no side effects)."""
        k = self.state.k
        if not blocks or any((b.block_size or self.mtp.block_size) > k for b in blocks):
            return None
        keys = [b.key for b in blocks if b.key is not None and b.key >= 0]
        if len(keys) != len(set(keys)):
            return None  # one slot per request
        ups = self.mtp.catch_up(blocks)
        widths = [(b.block_size or self.mtp.block_size) - 1 for b in blocks]
        live = [u is not None and w > 0 for u, w in zip(ups, widths)]
        # the eager step draws every sampled row's uniforms for the longest chain of the batch
        n = max((w for w, ok in zip(widths, live) if ok), default=0)
        rows = []
        for b, u, w, ok in zip(blocks, ups, widths, live):
            catch = tuple(u[1]) if ok else ()  # positions u[0] = start − len(catch) ..
            rows.append(MTPRow(b.last_token, b.start_pos, w, catch, tuple(b.page_table),
                               sampling=self._sampling(b, n) if ok else None))
        try:
            self.state.check(rows)
        except ValueError:
            return None
        return rows, ups

    @staticmethod
    def _sampling(b: DraftBlock, n: int) -> RowSampling | None:
        s = b.sampling
        if s is None:
            return None
        u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(s.seed))
        return RowSampling(s.temperature, s.top_k if s.top_k > 0 else NO_TOP_K, s.top_p, s.min_p, tuple(u.tolist()))

    def load(self, blocks: Sequence[DraftBlock], rows: list[MTPRow], ups: list) -> list[MTPRow]:
        """Slots for the rows (a request keeps its own), the catch-up rows the slots do not
        already hold copied in, and the state updated; returns the rows with their slots."""
        keys = [b.key if b.key is not None and b.key >= 0 else None for b in blocks]
        self.slots = {key: s for key, s in self.slots.items() if key in set(keys)}
        free = sorted(set(range(self.state.max_bs)) - set(self.slots.values()))
        hid = self.state.hidden
        out = []
        for key, r, u in zip(keys, rows, ups):
            slot = self.slots.get(key) if key is not None else None
            if slot is None:
                slot = free.pop(0)
                if key is not None:
                    self.slots[key] = slot
            c = len(r.catch)
            if c and u[2].data_ptr() != hid[slot].data_ptr():  # not this slot's rows from the last graph step
                hid[slot, :c].copy_(u[2], non_blocking=True)
            out.append(replace(r, slot=slot))
        self.state.update(out)
        return out

    def finish(self, blocks: Sequence[DraftBlock], rows: list[MTPRow], outputs: Outputs) -> SpecOutput:
        """The padded step's outputs per request as the eager step returns them (one device→host
        copy), and the kept state: views of the slots' rows."""
        m, k, s = len(rows), self.state.k, self.state.s
        sampled = [i for i, r in enumerate(rows) if r.sampling is not None]
        lg, q, host = self.read(outputs, m, sampled)
        drafts, greedy, lgs, probs, state = [], [], [], [], {}
        for i, (b, r, t) in enumerate(zip(blocks, rows, host)):
            n = t[-1]
            drafts.append(t[: n - 1])
            greedy.append(t[s : s + n])
            lgs.append(lg[i * k : i * k + n])
            probs.append(q[i][: n - 1] if i in q and n > 1 else None)
            if b.key is not None and b.key >= 0:
                state[b.key] = (b.start_pos, [b.last_token, *drafts[-1]], self.state.hidden[r.slot, :n])
        self.mtp.state = state
        return SpecOutput(drafts, lgs, greedy, probs if any(p is not None for p in probs) else None)

    def read(self, outputs: Outputs, m: int, sampled: list[int]) -> tuple[torch.Tensor, dict, list[list[int]]]:
        """The first m rows' verify logits (a copy: the next replay overwrites the graph's), the
        q of the `sampled` rows (only those: vocab-wide rows) and the tokens on the host (the
        step's one device→host copy)."""
        tokens, logits, q = outputs
        lg = logits[: m * self.state.k].clone()
        qs = {}
        if q is not None and sampled:
            idx = torch.tensor(sampled, dtype=torch.long, pin_memory=q.device.type == "cuda")
            qs = dict(zip(sampled, q.index_select(0, idx.to(q.device, non_blocking=True)).unbind(0)))
        return lg, qs, readback(tokens[:m]).tolist()

    def sampled(self, rows: Sequence[MTPRow]) -> bool:
        return any(r.sampling is not None for r in rows)

    @torch.inference_mode()
    def run_eager(self, blocks: Sequence[DraftBlock], bs: int, width: int) -> SpecOutput:
        """The whole static step run eagerly (no graph): rows, load, `mtp_forward`, finish."""
        rows, ups = self.rows(blocks)
        rows = self.load(blocks, rows, ups)
        return self.finish(blocks, rows, mtp_forward(self.runner, self.state, bs, width, self.sampled(rows)))


class MTPGraphs:
    """The captured MTP step graphs of one runner (whole model and its MTP layer, one CUDA rank)."""

    def __init__(self, runner, cfg: GraphConfig, pad_page: int):
        model, mtp = runner.model, runner.mtp
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if mtp is None or not (model.is_first and model.is_last) or model.tp.size != 1:
            raise ValueError("MTP step graphs hold the whole model and its MTP layer on one rank")
        self.k = cfg.block or mtp.block_size
        if not 2 <= self.k <= mtp.block_size:
            raise ValueError(f"verify width {self.k} outside [2, the MTP's block size {mtp.block_size}]")
        ps = runner.page_size
        max_pages = -(-cfg.max_context // ps)
        self.sizes = batch_buckets(cfg.max_bs)
        self.widths = width_buckets(max_pages, ps)
        self.steps = MTPSteps(runner, cfg.max_bs, max_pages, pad_page, self.k)
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.replays = 0
        self.capture()

    @property
    def state(self) -> MTPState:
        return self.steps.state

    @torch.inference_mode()
    def run_eager(self, bs: int, width: int, sampled: bool) -> Outputs:
        """The step the graphs hold, run eagerly on the state as it is."""
        return mtp_forward(self.steps.runner, self.state, bs, width, sampled)

    def capture(self) -> None:
        t0 = time.perf_counter()
        # (bs, sampled) pairs in capture_buckets' batch-size place: both variants of a bucket go
        # into the one memory pool, largest batch first.
        variants = [(bs, sampled) for bs in self.sizes for sampled in (False, True)]
        got = capture_buckets(self.steps.runner.device, variants, self.widths,
                              lambda v, width: self.run_eager(v[0], width, v[1]))
        self.graphs = {(v[0], width, v[1]): g for (v, width), g in got.items()}
        # The read-back's kernels (the copies, the q gather) load now, not at the first step.
        self.steps.read(self.graphs[(self.sizes[0], self.widths[0], True)][1], 1, [0])
        log.info("captured %d MTP step graphs (verify width %d, batch %s, widths %s pages, greedy and sampled) in "
                 "%.1f s", len(self.graphs), self.k, list(self.sizes), list(self.widths), time.perf_counter() - t0)

    def bucket(self, blocks: Sequence[DraftBlock]) -> tuple[list[MTPRow], list, tuple[int, int, bool]] | None:
        """The step's rows, catch-up sources and (batch size, width, sampled) graph, or None: run
        it eagerly. Eager: more requests than the largest bucket, positions past the widest
        graph, a block wider than the captured verify, a request key twice, and masked batches
        (`ctx_start` > 0, prefill sent no MTP KV: `draft_kv_transfer: false`). Those take the
        indexer's masked top-k (`Indexer._topk_from`: a dense top-k over positions, not the paged
        one), a second kernel path; graphing it would double the captured graphs for a degraded
        configuration whose drafts are short anyway (no seed travels there either)."""
        if not blocks or any(b.ctx_start > 0 for b in blocks):
            return None
        plan = self.steps.rows(blocks)
        if plan is None:
            return None
        rows, ups = plan
        bs = pick(self.sizes, len(rows))
        width = pick(self.widths, self.state.width_needed(rows))
        if bs is None or width is None:
            return None
        return rows, ups, (bs, width, self.steps.sampled(rows))

    def launch(self, blocks: Sequence[DraftBlock], rows: list[MTPRow], ups: list,
               key: tuple[int, int, bool]) -> tuple[list[MTPRow], Outputs]:
        """State load and replay, no host sync: the rows with their slots and the graph's outputs
        (valid until the next replay)."""
        rows = self.steps.load(blocks, rows, ups)
        g, out = self.graphs[key]
        g.replay()
        self.replays += 1
        return rows, out

    def step(self, blocks: Sequence[DraftBlock], rows: list[MTPRow], ups: list,
             key: tuple[int, int, bool]) -> SpecOutput:
        """`launch`, then the step read back (one device→host copy) and the kept state set."""
        rows, out = self.launch(blocks, rows, ups, key)
        return self.steps.finish(blocks, rows, out)


"""CUDA graphs of the DFlash decode step: propose, verify and the draft context write, one graph
per (batch size, width) bucket, over the static buffers of a `SpecState` (models/spec_state.py).

Eagerly, a DFlash step is the draft's forward, a device→host copy of its proposals, the verify
batch built from Python lists and copied back, the target forward with the draft context write,
then one host read per request to accept: on a small model hundreds of launches and several
syncs, several times the plain decode step. Here the proposals never leave the device: the graph
drafts, builds the verify tokens from the drafts, verifies, writes the draft context of the
verified positions and takes the argmax of every verify row; the host then reads the drafts and
those argmaxes in one copy (`SpecOutput.greedy`) and accepts (spec.py) outside the graph.

As models/graph.py: the smallest captured batch size >= the batch (padding rows are the state's
padding request), the smallest captured width >= the pages the step's positions reach (kernel
widths fixed per bucket), graphs captured largest first into one memory pool at start-up, and
everything else eager (`ModelRunner.spec_step`): more requests than the largest bucket, a block
wider than the captured verify width, positions past the widest graph. `bucket` is the one place
that decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from glm53.models.draft import DraftBlock
from glm53.models.graph import GraphConfig, batch_buckets, capture_buckets, pick, width_buckets
from glm53.models.readback import readback
from glm53.models.spec_state import SpecOutput, SpecState, StepRow

log = logging.getLogger(__name__)


def step_rows(blocks: Sequence[DraftBlock], draft_block: int) -> list[StepRow]:
    """The blocks as host rows (a block without `block_size` verifies the draft's `draft_block`)."""
    return [StepRow(b.last_token, b.start_pos, b.ctx_start, b.block_size or draft_block, tuple(b.page_table),
                    b.end_pos) for b in blocks]


def spec_forward(runner, state: SpecState, bs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step the graphs hold, on the state's first `bs` rows at `width` pages, device ops only:
    (tokens [bs, 2K] long: the K − 1 drafts, the target's argmax of each of the K verify rows,
    then the tokens each row verified — its n, or fewer when DSpark's confidence cut ended the
    block early, which only masks more verify positions, so one graph serves every cut; the
    verify logits [bs·K, vocab] fp32). Writes the verify tokens' target KV and draft context KV
    (padding tokens on the padding page), then moves the state's rows to the next step as greedy
    acceptance would (`SpecState.advance`)."""
    draft, model = runner.draft, runner.model
    d = state.draft_inputs(bs, width, draft.inv_freq)
    ctx = draft.paged_context(d.table, d.mask, runner.pools)  # read in place by the draft attention
    h = draft.block_hidden(model, d.ids, d.positions, ctx, rope=d.rope)
    choice = draft.choose(draft.logits_of(model, h, fp32=False), d.ids[:, 0], h)
    batch, n = state.verify_batch(bs, width, choice.tokens, choice.keep, model.inv_freq)
    out = runner.forward_batch(batch)
    logits = model.head(model.normed_hidden(out))
    tokens = torch.cat([choice.tokens, logits.argmax(dim=-1).view(bs, state.k), n[:, None]], dim=1)
    state.advance(bs, tokens)  # the next step's rows, for a launch before the host reads this one
    return tokens, logits


def split_output(rows: Sequence[StepRow], k: int, tokens: list[list[int]], logits: torch.Tensor) -> SpecOutput:
    """Per request, its n − 1 drafts, n verify logits rows and their argmaxes (n as the step
    verified it, the last column), out of the padded step's host tokens [≥ len(rows)][2K] and
    device logits [≥ len(rows)·K, vocab]."""
    ns = [t[-1] for t in tokens[: len(rows)]]
    return SpecOutput(
        drafts=[t[: n - 1] for n, t in zip(ns, tokens)],
        logits=[logits[i * k : i * k + n] for i, n in enumerate(ns)],
        greedy=[t[k - 1 : k - 1 + n] for n, t in zip(ns, tokens)],
    )


class SpecGraphs:
    """The captured DFlash step graphs of one runner (whole model and its draft, one CUDA rank).
    `capture=False` captures nothing: every launch runs the step the graphs hold eagerly on the
    state, on any device (how the CPU tests drive the overlapped loop through this code)."""

    def __init__(self, runner, cfg: GraphConfig, pad_page: int, capture: bool = True):
        model, draft = runner.model, runner.draft
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if draft is None or not (model.is_first and model.is_last) or model.tp.size != 1:
            raise ValueError("DFlash step graphs hold the whole model and its draft on one rank")
        self.k = cfg.block or draft.cfg.block_size
        if not 2 <= self.k <= draft.cfg.block_size:
            raise ValueError(f"verify width {self.k} outside [2, the draft's block size {draft.cfg.block_size}]")
        self.runner = runner
        ps = runner.page_size
        max_pages = -(-cfg.max_context // ps)
        self.sizes = batch_buckets(cfg.max_bs)
        self.widths = width_buckets(max_pages, ps)
        self.state = SpecState(cfg.max_bs, max_pages, ps, pad_page, self.k, draft.cfg.mask_token_id,
                               model.cfg.max_position_embeddings, runner.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.replays = 0
        self.chained = 0  # launches on rows the device advanced (`relaunch`)
        self._rows_held = 0  # requests of the last `launch`: what `relaunch` runs again
        if capture:
            self.capture()

    @torch.inference_mode()
    def run_eager(self, bs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step the graphs hold, run eagerly on the state as it is."""
        return spec_forward(self.runner, self.state, bs, width)

    def capture(self) -> None:
        t0 = time.perf_counter()
        self.graphs = capture_buckets(self.runner.device, self.sizes, self.widths, self.run_eager)
        log.info("captured %d DFlash step graphs (verify width %d, batch %s, widths %s pages) in %.1f s",
                 len(self.graphs), self.k, list(self.sizes), list(self.widths), time.perf_counter() - t0)

    def bucket(self, blocks: Sequence[DraftBlock]) -> tuple[list[StepRow], tuple[int, int]] | None:
        """The step's rows and the (batch size, width) of the graph that holds them, or None:
        run the step eagerly (which also raises the clear error for a block nothing can hold)."""
        if not blocks:
            return None
        if any(b.sampling is not None for b in blocks):
            return None  # sampled drafting (host-seeded uniforms, per-request filters) runs eagerly
        rows = step_rows(blocks, self.runner.draft.cfg.block_size)
        try:
            self.state.check(rows)
        except ValueError:
            return None
        bs = pick(self.sizes, len(rows))
        width = pick(self.widths, self.state.width_needed(rows))
        if bs is None or width is None:
            return None
        return rows, (bs, width)

    def launch(self, rows: list[StepRow], key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """State update and replay, no host sync: the graph's (tokens, logits) outputs, valid
        until the next replay."""
        self.state.update(rows)
        self._rows_held = len(rows)
        return self._replay(key)

    def relaunch(self, m: int, reach: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step after the last one for the same `m` requests, on the rows the device moved
        there (`SpecState.advance`), with no host update and no sync; None when no graph's
        width covers `reach`, the host's bound on the position any row's tokens stop before."""
        if m != self._rows_held:
            raise ValueError(f"relaunch of {m} requests after a launch of {self._rows_held}")
        bs = pick(self.sizes, m)
        width = pick(self.widths, -(-reach // self.runner.page_size))
        if bs is None or width is None:
            return None
        self.chained += 1
        return self._replay((bs, width))

    def _replay(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.replays += 1
        if not self.graphs:  # capture=False
            return self.run_eager(*key)
        g, out = self.graphs[key]
        g.replay()
        return out

    def step(self, rows: list[StepRow], key: tuple[int, int]) -> SpecOutput:
        """`launch`, a copy of the logits (the next replay overwrites the graph's), then the step's
        one device→host copy: the drafts, the verify argmaxes and the verified counts."""
        tokens, logits = self.launch(rows, key)
        m = len(rows)
        lg = logits[: m * self.k].clone()
        return split_output(rows, self.k, readback(tokens[:m]).tolist(), lg)

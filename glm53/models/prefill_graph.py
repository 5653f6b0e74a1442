"""CUDA graphs of a short prompt chunk's forward: one request, up to `max_tokens` tokens.

A prompt forward on a small model, or a short chunk on a large one, is bound by the host: the
embedded pair's 200-token prompt launches ~330 kernels, 1.0 ms of GPU work behind ~17 ms of
Python and launches on the H200. A graph replays that forward for any chunk of one request whose
tokens fit its bucket: the chunk's tokens, start and count travel in one small non-blocking copy
into static buffers, and the batch is derived on the device (`spec_state.padded_batch`: tokens
past the chunk are padding tokens on the padding page). The forward is the runner's own
(`forward_batch`: the target's KV, the draft's context KV with a draft), then the logits of the
chunk's last token.

As models/graph.py: the smallest token bucket ≥ the chunk and the smallest width ≥ the pages its
positions reach, captured largest first into one memory pool at start-up; anything else runs
eagerly (`ModelRunner.forward`): several chunks at once, every row's logits, a chunk longer than
the largest bucket, positions past the widest graph. `bucket` is the one place that decides.
`capture=False` captures nothing and runs the same forward eagerly on the static buffers (the
CPU tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from glm53.models.graph import capture_buckets, pick, width_buckets
from glm53.models.spec_state import padded_batch

# The longest prompt chunk a prefill rank's graphs hold (engine/worker.py; server/plan.py reserves
# their pool): a short prompt's forward is bound by the host's launches (the embedded pair's 200
# tokens: ~1 ms of GPU work, ~17 ms eager on the H200); past a few hundred tokens the GPU's own
# time dominates and a graph's pool would only grow.
PREFILL_GRAPH_TOKENS = 256

log = logging.getLogger(__name__)

MIN_TOKENS = 32  # the smallest bucket; one-token chunks are decode's


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """MIN_TOKENS, 2·MIN_TOKENS, ... up to `max_tokens` (itself the last)."""
    out, t = [], MIN_TOKENS
    while t < max_tokens:
        out.append(t)
        t *= 2
    return tuple(out + [max_tokens])


class PrefillGraphs:
    """The captured prompt-chunk graphs of one runner (whole model, one rank)."""

    def __init__(self, runner, max_tokens: int, max_context: int, pad_page: int, capture: bool = True):
        model = runner.model
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not (model.is_first and model.is_last) or model.tp.size != 1 or runner.mtp is not None:
            raise ValueError("prefill graphs hold the whole model (no MTP layer) on one rank")
        if max_tokens < 2:
            raise ValueError(f"prefill graphs need max_tokens >= 2, got {max_tokens}")
        self.runner = runner
        ps = runner.page_size
        self.max_pages = -(-max_context // ps)
        self.max_position = min(max_context, model.cfg.max_position_embeddings)
        self.sizes = token_buckets(max_tokens)
        self.widths = width_buckets(self.max_pages, ps)
        dev = runner.device
        self.ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=dev)
        self.meta = torch.tensor([0, 1], dtype=torch.long, device=dev)  # start, tokens
        self.table = torch.full((1, self.max_pages), -1, dtype=torch.int32, device=dev)
        self.table[0, 0] = pad_page
        self._pad_row = self.table[0].clone()
        self._j = torch.arange(self.sizes[-1], device=dev)  # a constant of the batch's derivation
        self._pin = dev.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        if capture:
            t0 = time.perf_counter()
            self.graphs = capture_buckets(dev, self.sizes, self.widths, self.run_eager)
            log.info("captured %d prefill graphs (tokens %s, widths %s pages) in %.1f s", len(self.graphs),
                     list(self.sizes), list(self.widths), time.perf_counter() - t0)

    @torch.inference_mode()
    def run_eager(self, tokens: int, width: int) -> torch.Tensor:
        """The forward the graphs hold, on the static buffers: the chunk's last logits [1, vocab] fp32."""
        r = self.runner
        start, n = self.meta[0:1], self.meta[1:2]
        batch, _ = padded_batch(self.ids[None, :tokens], start, n, self.table, self._pad_row, width, r.page_size,
                                self._j)
        return r.model.head(r.model.normed_hidden(r.forward_batch(batch), n - 1))

    def bucket(self, chunks: Sequence) -> tuple[int, int] | None:
        """(tokens, width) of the graph that holds `chunks`, or None: run them eagerly."""
        if len(chunks) != 1:
            return None
        c = chunks[0]
        n, end = len(c.token_ids), c.start_pos + len(c.token_ids)
        if n < 2 or c.all_logits or end > self.max_position or len(c.page_table) > self.max_pages \
                or -(-end // self.runner.page_size) > len(c.page_table):
            return None  # (an impossible chunk runs eagerly, which raises the clear error)
        tokens = pick(self.sizes, n)
        width = pick(self.widths, -(-end // self.runner.page_size))
        if tokens is None or width is None:
            return None
        return tokens, width

    def forward(self, chunks: Sequence, key: tuple[int, int]) -> list[torch.Tensor]:
        """The chunk's last logits [1, vocab] fp32 (a copy: the next replay overwrites the
        graph's), with no host sync."""
        c = chunks[0]
        n, pages = len(c.token_ids), list(c.page_table)
        host = torch.tensor([c.start_pos, n, *c.token_ids], dtype=torch.long, pin_memory=self._pin)
        table = torch.tensor([pages + [-1] * (self.max_pages - len(pages))], dtype=torch.int32, pin_memory=self._pin)
        self.meta.copy_(host[:2], non_blocking=True)
        self.ids[:n].copy_(host[2:], non_blocking=True)
        self.table.copy_(table, non_blocking=True)
        self.replays += 1
        if not self.graphs:  # capture=False
            return [self.run_eager(*key).clone()]
        g, out = self.graphs[key]
        g.replay()
        return [out.clone()]

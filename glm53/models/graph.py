"""CUDA graphs for the decode forward at bucketed batch sizes and page-table widths.

A decode step on a small model is launch-bound: hundreds of kernels whose launches cost more than
their work. Capturing the whole step (the device-side batch derivation, every layer, the final
norm and the lm_head) once per (batch size, width) bucket and replaying it costs one launch.

- The inputs live in a `DecodeState` (static buffers, updated incrementally); a batch of n
  requests runs the smallest captured batch size >= n, the rows past n being the state's padding
  request (its KV goes to the reserved padding page), and the smallest captured width >= its
  longest page table (kernel widths are fixed per bucket: `max_context = width * page_size`).
- Widths step by 4x from 4K tokens up to the instance's longest request, so a short-context
  batch does not pay for the longest one's widths.
- Everything the graph cannot hold runs eagerly (`ModelRunner.build_batch`): more requests than
  the largest bucket, chunks of more than one token (prefill, verify), pipeline stages and tensor
  parallelism. A runner with a DFlash draft captures its speculative step instead
  (models/spec_graph.py, the same design).
- Graphs share one memory pool and are captured largest first, at start-up; warm-up and capture
  only ever write the padding page.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from glm53.kernels.compile_watch import WATCH
from glm53.models import overlap
from glm53.models.decode_state import DecodeState

log = logging.getLogger(__name__)

MIN_WIDTH_TOKENS = 4096  # the narrowest captured width
WIDTH_STEP = 4  # each captured width is this many times the previous one


def batch_buckets(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, ... below `max_bs`, then `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    out, b = [], 1
    while b < max_bs:
        out.append(b)
        b *= 2
    return tuple(out + [max_bs])


def width_buckets(max_pages: int, page_size: int) -> tuple[int, ...]:
    """Page-table widths (pages): MIN_WIDTH_TOKENS, then x WIDTH_STEP, up to `max_pages`."""
    out, w = [], -(-MIN_WIDTH_TOKENS // page_size)
    while w < max_pages:
        out.append(w)
        w *= WIDTH_STEP
    return tuple(out + [max_pages])


@dataclass(frozen=True)
class GraphConfig:
    """`max_bs`: the largest captured decode batch (0: no decode graphs); `max_context`: the
    longest request (tokens) a graph must hold (the model's context length or less); `block`: with
    a DFlash draft, the tokens a verify step checks, the bonus slot included (None: the draft's
    block size); `prefill_tokens`: the longest prompt chunk of one request a prefill graph holds
    (0: none; models/prefill_graph.py)."""

    max_bs: int
    max_context: int
    block: int | None = None
    prefill_tokens: int = 0


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector run once now, then off until the block ends. A CUDA graph
    that only a dead reference cycle holds (a dropped runner: its graphs hold it back) is freed when
    the collector gets to it; freed while another graph is being captured, its teardown is an
    operation not permitted during a capture, which invalidates that capture (torch's
    `torch.cuda.graph` no longer collects before it begins). So a capture starts after the
    collection and none runs inside it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def pick(buckets: Sequence[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


@torch.inference_mode()
def capture_buckets(device: torch.device, sizes: Sequence[int], widths: Sequence[int],
                    run: Callable[[int, int], Any]) -> dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Any]]:
    """One CUDA graph of `run(bs, width)` per bucket, largest first, into one memory pool:
    {(bs, width): (graph, the outputs its replays overwrite)}. The decode step's and the DFlash
    step's graphs are both captured here."""
    graphs = {}
    # Start-up work: its compiles are warm-up's, also for a runner built after another one in the
    # process has warmed up (a colocated pair; tools/eval_dflash.py's runners, one per mode).
    with WATCH.warming(), torch.cuda.device(device), collector_paused():  # capture streams: the current device's
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        capture = overlap.capture_stream(device)  # the main chain's priority beside the side stream's
        for width in reversed(widths):
            for bs in reversed(sizes):
                # Warm-up compiles every Triton variant of the bucket outside the capture.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        run(bs, width)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=capture):
                    out = run(bs, width)
                graphs[(bs, width)] = (g, out)
        torch.cuda.synchronize(device)
    return graphs


class DecodeGraphs:
    """The captured decode graphs of one runner (whole model, single rank, CUDA)."""

    def __init__(self, runner, cfg: GraphConfig, pad_page: int):
        model = runner.model
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not (model.is_first and model.is_last) or model.tp.size != 1 or runner.projection is not None:
            raise ValueError("decode graphs hold the whole model on one rank without a draft")
        self.runner = runner
        ps = runner.page_size
        self.max_pages = -(-cfg.max_context // ps)
        self.sizes = batch_buckets(cfg.max_bs)
        self.widths = width_buckets(self.max_pages, ps)
        self.state = DecodeState(cfg.max_bs, self.max_pages, ps, pad_page, model.cfg.max_position_embeddings,
                                 runner.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        self.capture()

    def run_eager(self, bs: int, width: int) -> torch.Tensor:
        """The step the graphs hold, run eagerly on the state's first `bs` rows: logits [bs, vocab]
        as the lm_head gives them, in the model's dtype. Their fp32 form, the model's logits, is an
        exact widening, so the graph leaves it to its readers: the sampler reads either (its argmax
        is the same index), and `forward`'s copy widens them."""
        r = self.runner
        batch = self.state.batch(bs, width, r.model.inv_freq)
        return r.model.lm_head(r.model.normed_hidden(r.model.forward_stage(batch, r.pools, None)))

    def capture(self) -> None:
        t0 = time.perf_counter()
        self.graphs = capture_buckets(self.runner.device, self.sizes, self.widths, self.run_eager)
        log.info("captured %d decode graphs (batch %s, widths %s pages) in %.1f s", len(self.graphs),
                 list(self.sizes), list(self.widths), time.perf_counter() - t0)

    def bucket(self, chunks: Sequence) -> tuple[int, int] | None:
        """(batch size, width) of the graph that holds `chunks`, or None: run them eagerly."""
        if not chunks or any(len(c.token_ids) != 1 or c.all_logits for c in chunks):
            return None
        bs = pick(self.sizes, len(chunks))
        width = pick(self.widths, max(len(c.page_table) for c in chunks))
        if bs is None or width is None:
            return None
        return bs, width

    def run(self, chunks: Sequence, key: tuple[int, int], tokens=None) -> torch.Tensor:
        """Replays the graph `key` on `chunks`: logits [len(chunks), vocab] in the model's dtype
        (`run_eager`), a view of the graph's output, which the next replay overwrites. `tokens`
        (runner.DeviceTokens): inputs still on the device."""
        self.state.update(chunks, tokens)
        g, out = self.graphs[key]
        g.replay()
        self.replays += 1
        return out[: len(chunks)]

    def forward(self, chunks: Sequence, key: tuple[int, int], tokens=None) -> list[torch.Tensor]:
        """Per chunk, its logits [1, vocab] fp32 (a copy that outlives the next replay)."""
        return list(self.run(chunks, key, tokens).to(torch.float32, copy=True).split(1))

"""A decode step's independent small ops on a side stream, beside the main chain (CUDA).

At decode sizes an MLA layer is mostly a chain of small, latency-bound kernels, but not all of it
is one chain: the store of the latent and index-key rows and the indexer's head gates need only
the input product and the normed input, while the main stream runs the q_a norm and the q_b
product; the absorbed query needs only q, while the main stream runs the indexer's logits and
top-k (at up to `INDEX_FIRST_MAX_ROWS` rows the q_b product too, the indexer's own query product
going first). Queued on a second stream (`Branch`: forked from the main stream, joined before anything
reads what it made) they run beside those kernels, and a CUDA graph captured so holds both
branches. The values are the same either way: each kernel computes what it computes alone.

Memory needs no `record_stream`: a fork makes the side stream wait for everything the main stream
has queued, and the main stream waits for the branch before it reads the branch's outputs. So a
block the caching allocator hands the side stream again was last read by work that fork waited
for, and the branch's inputs (the main stream's tensors) are held by the layer's locals until
after the join.

Timed in the FP8 slice's graphed decode step on an H100 (2026-12-06, `benchmarks/early_launch.py`):
batch 1 1,028.3 µs against 1,039.2 on one stream, 1,017.9 with the early launches too (1,025.4
without the side stream); batch 64 unchanged. On.
"""

from __future__ import annotations

import contextlib

import torch

SIDE_STREAM = True
# Up to this many rows (0: never), the indexer's query product runs first on the main stream and
# the q_b product and the absorbed query beside its logits and top-k (two products where q_b and
# wq_b were one: `Attention._index_first`). H100, the FP8 slice's graphed step (2026-12-06):
# batch 1 942.1 -> 924.4 us, 4: 1,021.1 -> 1,007.8, but 16: 1,202.6 -> 1,214.2; logits bit-equal.
# With the main chain's priority above the side stream's (`MAIN_PRIORITY`) it pays at every decode
# size (2026-12-07, against 4 rows: 8 rows 1,093.5 -> 1,078.0 and 1,093.4 -> 1,076.9 us, 16 rows
# 1,202.9 -> 1,185.6 and 1,203.0 -> 1,187.0; 1 to 4 rows even): all of `MAX_TOKENS`.
INDEX_FIRST_MAX_ROWS = 16
# With the indexer's product first, the query's branch forks before it (q_b and the indexer's
# query product side by side) rather than after it: with the one-launch rank top-k the indexer's
# chain is no longer the longer branch. H100, the FP8 slice's batch-1 step (2026-12-07): 909.2 ->
# 901.9 us (912.8 with neither); the same kernels, logits bit-equal.
QUERY_FORKS_FIRST = True
# Rows of a step that forks: decode sizes (the absorbed query's own kernel runs up to as many).
MAX_TOKENS = 16
# The decode graphs' capture stream's priority (CUDA: lower is higher; 0, the default, is the
# lowest and the side stream's): a captured kernel keeps its stream's priority when the graph
# replays (PyTorch instantiates graphs with per-node priority), so where both streams have programs
# waiting the block scheduler starts the main chain's first. That is the indexer's logits and top-k
# beside q_b (`INDEX_FIRST_MAX_ROWS`): H100, the FP8 slice's graphed step (2026-12-07,
# benchmarks/step_knobs.py, three rounds each, two machines) batch 1 917.9 -> 908.2 and 920.8 ->
# 912.5 us, batch 4 974.0 -> 971.5 and 1,007.9 -> 999.1, 16 even; logits bit-equal. The side stream
# at a higher priority than the main one changed nothing (918.0 us), and the query's branch on a
# stream of its own, so q_b need not queue behind the cache rows, was slower (933.6: q_b then
# takes the SMs the indexer's chain needs).
MAIN_PRIORITY = -1


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream a runner on `device` gives its model's decode steps: one when `SIDE_STREAM`
    is on and the device is CUDA (read when the runner is built), else None."""
    return torch.cuda.Stream(device) if SIDE_STREAM and device.type == "cuda" else None


def capture_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream the decode graphs are captured on: one of `MAIN_PRIORITY` when that is set, else
    None (`torch.cuda.graph`'s own, of the default priority)."""
    return torch.cuda.Stream(device, priority=MAIN_PRIORITY) if MAIN_PRIORITY and device.type == "cuda" else None


class Branch:
    """Work queued on `side` inside the `with` block, forked at this object's creation (after what
    the current stream queued so far); `join` makes the current stream wait for that work, and
    only that. With `side` None the block runs in line on the current stream and `join` does
    nothing."""

    def __init__(self, side: torch.cuda.Stream | None):
        self.side = side
        self.main = torch.cuda.current_stream(side.device) if side is not None else None
        if side is not None:
            side.wait_stream(self.main)

    def __enter__(self) -> Branch:
        self._ctx = torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        if self.side is not None:
            # the branch's end, marked now: a join waits for this branch only, not for what
            # another branch queues on the same side stream after it
            self._done = torch.cuda.Event()
            self._done.record(self.side)

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_event(self._done)

"""GPU time of kernel calls for benchmarks: the calls captured in one CUDA graph (so no launch or
Python time is counted), replayed between two events; the median over the replays."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from glm53.models.graph import collector_paused


def graph_ms(calls: Sequence[Callable[[], object]], reps: int = 30, warm_replays: int = 3) -> float:
    """Median ms per call of a CUDA graph that runs `calls` in order. Each call runs once eagerly
    and once on a side stream first (compiles, autotuning and allocator pools happen outside the
    capture)."""
    for f in calls:
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(g):
        for f in calls:
            f()
    for _ in range(warm_replays):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / len(calls))
    del g
    return statistics.median(ts)

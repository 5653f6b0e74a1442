"""Wall time of a step as a serving loop sees it (host work and the device's, synchronized before
each call), the median over the calls after the first three (which compile, capture or warm
caches); shared by the step benchmarks (benchmarks/spec_steps.py, mtp_steps.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_step_ms(fn: Callable[[int], None], iters: int, sync: Callable[[], None]) -> float:
    """fn(i) for i < iters, each call timed from a synchronized start to its return; ms."""
    if iters < 4:
        raise ValueError("iters must be at least 4: the first three calls are not counted")
    times = []
    for it in range(iters):
        sync()
        t = time.perf_counter()
        fn(it)
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3

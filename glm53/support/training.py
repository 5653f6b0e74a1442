"""Pieces of the training loops of tools/train_tiny.py and tools/distill_draft.py: the log line,
the step budget (a step count, or as many steps as fit a time budget) and the learning-rate
schedule (linear warm-up, then cosine down to a tenth of the peak)."""

from __future__ import annotations

import math
import time


def log(*a):
    print(*a, flush=True)


class StepBudget:
    """How many steps a training run takes: `steps` when given, else as many as fit `seconds`,
    from the rate of steps 10..40 (after the warm-up). `total` is the step count so far."""

    def __init__(self, steps: int, seconds: float, name: str):
        self.steps, self.seconds, self.name = steps, seconds, name
        self.total = steps or 10**9
        self.t0 = time.time()
        self.t10 = 0.0

    def tick(self, step: int) -> None:
        if self.steps:
            return
        if step == 10:
            self.t10 = time.time()
        elif step == 40:
            rate = 30 / (time.time() - self.t10)
            self.total = max(60, int((self.seconds - (self.t10 - self.t0)) * rate) + 10)
            log(f"{self.name}: {rate:.2f} steps/s -> {self.total} steps")

    def elapsed(self) -> float:
        return time.time() - self.t0


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

"""glm53/support/training.py's StepBudget: the step count of a training run, fixed or fitted to a
time budget from the rate after the warm-up (the training loops of tools/train_tiny.py and
tools/distill_draft.py)."""

from __future__ import annotations

import glm53.support.training as training
from glm53.support.training import StepBudget


def test_fixed_steps_are_kept():
    b = StepBudget(123, 999.0, "x")
    for step in range(60):
        b.tick(step)
    assert b.total == 123


def test_steps_fit_the_seconds_from_the_rate_after_warm_up(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(training.time, "time", lambda: now[0])
    b = StepBudget(0, 60.0, "x")
    assert b.total == 10**9
    now[0] = 104.0  # 10 warm-up steps took 4 s
    b.tick(10)
    now[0] = 110.0  # then 30 steps in 6 s: 5 steps/s for the 56 s left
    b.tick(40)
    assert b.total == 56 * 5 + 10 and b.elapsed() == 10.0
    b.tick(41)
    assert b.total == 290

"""server/heap.py: a settled process's start-up objects leave the collector's generations, later
objects do not, and a collection over the threshold is logged as a pause."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from glm53.server.heap import PauseLog

FROZEN_CHILD = r"""
import gc
from glm53.server import heap
held = [[i] for i in range(50_000)]  # start-up's containers
heap.settle()
frozen = gc.get_freeze_count()
walked = {id(o) for o in gc.get_objects()}
later = [[i] for i in range(10)]  # serving's
print(frozen >= 50_000, any(id(x) in walked for x in held[::5000]), all(id(x) in {id(o) for o in gc.get_objects()} for x in later),
      sum(isinstance(c, heap.PauseLog) for c in gc.callbacks))
heap.thaw()
print(gc.get_freeze_count())
"""


def test_settle_freezes_startup_objects_only():
    out = subprocess.run([sys.executable, "-c", FROZEN_CHILD], capture_output=True, text=True, timeout=120, check=True)
    first, second = out.stdout.split("\n")[:2]
    assert first.split() == ["True", "False", "True", "1"]  # frozen; not walked; later ones walked; one hook
    assert second.strip() == "0"  # thawed: the collector walks them again


def test_pause_log_warns_over_threshold_only(caplog):
    hook = PauseLog(warn_s=0.02)
    with caplog.at_level(logging.WARNING, logger="glm53.server.heap"):
        hook("start", {})
        hook("stop", {"generation": 0, "collected": 3})  # fast: not a pause
        hook("start", {})
        time.sleep(0.03)
        hook("stop", {"generation": 2, "collected": 7})
    pauses = [r.getMessage() for r in caplog.records if "GC pause" in r.getMessage()]
    assert len(pauses) == 1 and "generation 2" in pauses[0]
    assert hook.count == 1 and hook.longest_s >= 0.03


SETTLED_EXIT = r"""
import gc
import triton  # its nanobind bindings count their live objects when the interpreter finalizes
from glm53.server import heap
held = [[i] for i in range(1_000_000)]  # enough for the final collection to pass PAUSE_WARN_S
heap.settle()
heap.settle()  # a rank group rebuilt in the process settles again
print(gc.get_freeze_count() > 0)
"""


def test_a_settled_process_exits_without_leak_or_pause_reports():
    out = subprocess.run([sys.executable, "-c", SETTLED_EXIT], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "True"
    assert "leaked" not in out.stderr, out.stderr[:500]
    assert "GC pause" not in out.stderr, out.stderr[:500]  # the exit's own collection stalls no loop

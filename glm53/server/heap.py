"""The Python heap of a serving process: frozen once the process is built, and long collections
logged.

Why: CPython's cyclic collector runs in whichever thread allocates past a threshold and holds the
GIL while it walks the generation it collects. A full (generation-2) pass walks every container
the process holds: the model's modules and parameters, captured CUDA graphs, Triton's and the
tokenizer's caches. While it runs no loop of the process moves: in a colocated pair a pass that
prefill's allocations trigger stops decode's loop with it, and every running request's next
token waits. `freeze()` moves what the process holds after start-up into the permanent
generation, which the collector never walks: its passes then visit only what serving allocated
since (vLLM and SGLang freeze after start-up for the same reason).

Frozen objects are still freed when their last reference goes; only cycles among them stay until
`thaw()` (a rank group rebuilt in the process, engine/node_ranks.py, frees the old group's).
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger(__name__)

# A collection longer than this is logged: it is a stall of every loop in the process.
PAUSE_WARN_S = 0.01


def freeze() -> int:
    """Collect what start-up left behind, then freeze the rest; returns how many objects froze."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("heap frozen after start-up: %d objects the collector will not walk again", n)
    return n


def thaw() -> None:
    """Before collecting what a torn-down part of the process left: frozen cycles are never
    collected, so give them back to the collector first."""
    gc.unfreeze()


class PauseLog:
    """A `gc.callbacks` hook that logs every collection longer than `warn_s` (its generation and
    duration): the one place a GC stall of the serving loops shows up. Installed once per process."""

    def __init__(self, warn_s: float = PAUSE_WARN_S):
        self.warn_s = warn_s
        self.count = 0  # collections over warn_s so far
        self.longest_s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        if took >= self.warn_s:
            self.count += 1
            self.longest_s = max(self.longest_s, took)
            log.warning("GC pause of %.1f ms (generation %d, %d collected): every loop of this process "
                        "waited", took * 1e3, info.get("generation", -1), info.get("collected", 0))

    @classmethod
    def install(cls, warn_s: float = PAUSE_WARN_S) -> "PauseLog":
        for cb in gc.callbacks:
            if isinstance(cb, cls):
                return cb
        hook = cls(warn_s)
        gc.callbacks.append(hook)
        return hook


def settle() -> None:
    """A serving process is built and about to serve: freeze its heap, then log long collections
    (from then on: start-up's own collection is not a stall of serving). At exit the heap thaws
    before the interpreter finalizes: frozen objects are never collected, and extension modules
    that count their live objects at exit (Triton's nanobind bindings) would print every one of
    them as a leak (~27 lines a process at each shutdown)."""
    freeze()
    PauseLog.install()
    atexit.unregister(release)  # once, however often a process settles
    atexit.register(release)


def release() -> None:
    """At exit, when no loop runs any more: the pause log goes (the final collections stall
    nothing) and the heap thaws."""
    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, PauseLog)]
    thaw()

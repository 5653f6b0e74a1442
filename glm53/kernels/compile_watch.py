"""Counting Triton compilations (and loads from the disk cache) in this process.

Triton calls `knobs.runtime.jit_cache_hook` whenever a launch misses its in-process kernel cache,
just before it compiles the variant or loads it from TRITON_CACHE_DIR; both hold every stream of
the process (kernels/variants.py says why that matters). `CompileWatch` installs itself there
(chaining any hook already set) and counts those misses: the ones inside `warming()` (the start-up
warm-up, on that thread) as expected, every other one as a compile after start-up, logged as a
warning with the kernel and its specialization, which is what a serving GPU benchmark counts
(`benchmarks/no_compiles.py`: zero after warm-up). Gluon kernels go through the same hook.

The hook is process state owned by Triton; `install()` is idempotent and `uninstall()` restores
the previous hook. Under TRITON_INTERPRET=1 or on CPU nothing compiles and nothing is counted.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

AFTER_WARMUP = "Triton compile after warm-up"  # the log line's prefix (benchmarks grep it)


@dataclass
class CompileEvent:
    name: str  # module.qualname of the kernel
    repr: str  # Triton's repr: options and the specialization of each argument
    warming: bool  # inside `warming()` on the compiling thread


@dataclass
class CompileWatch:
    events: list[CompileEvent] = field(default_factory=list)
    _prev: object = None
    _installed: bool = False
    _local: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        if self._installed:
            return
        from triton import knobs

        self._prev = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._prev
        self._installed = False

    def _hook(self, *args, **kwargs):
        fn, rep = kwargs.get("fn"), kwargs.get("repr", "")
        name = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}" if fn is not None else "?"
        warming = getattr(self._local, "depth", 0) > 0
        with self._lock:
            self.events.append(CompileEvent(name, rep, warming))
            after = sum(not e.warming for e in self.events)
        if not warming:
            log.warning("%s: %s (%d so far) %s", AFTER_WARMUP, name, after, rep)
        # the previous hook decides whether to skip the compile (a truthy return)
        return self._prev(*args, **kwargs) if callable(self._prev) else None

    @contextmanager
    def warming(self):
        """Compiles on this thread inside the block are the warm-up's (expected)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def count(self, warming: bool | None = None) -> int:
        with self._lock:
            return sum(1 for e in self.events if warming is None or e.warming == warming)

    def after_warmup(self) -> list[CompileEvent]:
        with self._lock:
            return [e for e in self.events if not e.warming]


# The process's watch: Triton's hook is one per process, so its counter is too.
WATCH = CompileWatch()

"""A diagnostic of a serving process's stalls, for benchmarks/colocate_stalls.py (never imported by
the server): a daemon thread that wakes every `tick_s` and writes JSON lines to
`DIR/stalls-<pid>.jsonl`, each with perf_counter times (CLOCK_MONOTONIC: comparable with a client's
timestamps on the same host):

- `{"kind": "gil", "t0", "t1"}`: the watcher woke `t1 - t0` late: some thread held the GIL that
  long (a C call that does not release it, a garbage collection); `stacks` are every thread's
  innermost frames as the watcher got the GIL back;
- `{"kind": "stuck", "thread", "t0", "t1", "stack"}`: a thread stayed in one frame, at one
  bytecode, for longer than `min_s` while the watcher ran: it waited with the GIL released (a GPU
  wait, a lock, a poll);
- `{"kind": "gc", "t0", "t1", "generation"}`: a garbage collection longer than `min_s`.

A process starts it by `start(directory)`; the benchmark makes every process of the server do so
through a `sitecustomize` module on PYTHONPATH (`sitecustomize_source`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time


def _stack(frame, depth: int = 6) -> list[str]:
    out = []
    while frame is not None and len(out) < depth:
        c = frame.f_code
        out.append(f"{os.path.basename(c.co_filename)}:{frame.f_lineno} {c.co_name}")
        frame = frame.f_back
    return out


class StallWatch:
    def __init__(self, path: str, tick_s: float = 0.001, min_s: float = 0.01):
        self.tick_s, self.min_s = tick_s, min_s
        self._out = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._gc_t0 = 0.0
        self._me = None

    def _write(self, rec: dict) -> None:
        with self._lock:
            self._out.write(json.dumps(rec) + "\n")

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            t1 = time.perf_counter()
            if t1 - self._gc_t0 >= self.min_s:
                self._write({"kind": "gc", "t0": self._gc_t0, "t1": t1, "generation": info.get("generation")})

    def _run(self) -> None:
        names = {}
        seen: dict[int, tuple] = {}  # thread id -> (frame id, lasti, since, stack)
        last = time.perf_counter()
        while True:
            time.sleep(self.tick_s)
            now = time.perf_counter()
            frames = sys._current_frames()
            if now - last > self.tick_s + self.min_s:
                self._write({"kind": "gil", "t0": last + self.tick_s, "t1": now,
                             "stacks": {names.get(i) or str(i): _stack(f, 4) for i, f in frames.items()
                                        if i != self._me}})
            last = now
            if len(names) != len(frames):
                names = {t.ident: t.name for t in threading.enumerate()}
            for ident, f in frames.items():
                if ident == self._me:
                    continue
                key = (id(f), f.f_lasti)
                prev = seen.get(ident)
                if prev is not None and prev[0] == key:
                    continue
                if prev is not None and now - prev[1] >= self.min_s:
                    self._write({"kind": "stuck", "thread": names.get(ident, str(ident)), "t0": prev[1],
                                 "t1": now, "stack": prev[2]})
                seen[ident] = (key, now, _stack(f))

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        t = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        t.start()
        self._me = t.ident


def start(directory: str) -> StallWatch:
    os.makedirs(directory, exist_ok=True)
    w = StallWatch(os.path.join(directory, f"stalls-{os.getpid()}.jsonl"))
    w.start()
    return w


def sitecustomize_source(directory: str, no_freeze: bool = False) -> str:
    """A `sitecustomize.py` that starts the watch in every Python process whose PYTHONPATH holds
    it; `no_freeze`: gc.freeze becomes a no-op (the server as it was before it froze its heap)."""
    lines = ["import gc", "from glm53.support import stall_watch",
             f"stall_watch.start({directory!r})"]
    if no_freeze:
        lines.append("gc.freeze = lambda: None")
    return "\n".join(lines) + "\n"


def read(directory: str) -> list[dict]:
    """Every record of every process, with its pid."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("stalls-") and name.endswith(".jsonl"):
            pid = int(name[len("stalls-"):-len(".jsonl")])
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:  # a line cut by the process's end
                        continue
                    rec["pid"] = pid
                    out.append(rec)
    return out

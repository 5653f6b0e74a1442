"""The Triton interpreter's processes (`test_interp_cases.py` under TRITON_INTERPRET=1; Triton reads
it at import, hence processes of their own): started once, read back once.

Two processes of about equal time, split by the per-test durations (one process on the 2-core
VM, 2026-12-06: 161 s of FIRST's cases, 162 s of the rest; the MoE GEMV and routing-plan cases,
30 s, had left FIRST at 191 against 132): the interpreter is single-threaded Python. The suite's
conftest starts them as soon as their test is collected, at the lowest CPU priority, so they take
the cores the rest of the suite leaves idle (its end-to-end tests mostly wait on servers) and
give them back whenever a test wants them; their test runs last and collects them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NODE = "test_interpreter.py::test_triton_kernels_under_interpreter"  # the end of its node id
# the first process's cases (-k); the second runs every other case
FIRST = "topk or draft_forward or test_model_"
STASH = pytest.StashKey[list]()  # the started runs, on the pytest config


@dataclass
class Run:
    proc: subprocess.Popen
    log: Path  # stdout and stderr together (a file: a pipe nobody reads would fill and stop it)


def start(niceness: int = 19) -> list[Run]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    # the interpreter's tl.dot is a numpy matmul of one tile: on a loaded 2-core machine,
    # OpenBLAS's worker threads made one 64x128x128 tile take ~20 ms instead of ~0.1 ms (measured)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "test_interp_cases.py"), "-k"]
    runs = []
    for sel in (FIRST, f"not ({FIRST})"):
        fd, name = tempfile.mkstemp(prefix="glm53-interp-", suffix=".log")
        with os.fdopen(fd, "w") as out:
            proc = subprocess.Popen(cmd + [sel], cwd=HERE.parents[1], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda: os.nice(niceness))
        runs.append(Run(proc, Path(name)))
    return runs


def finish(runs: list[Run], timeout: float) -> list[tuple[int | None, str]]:
    """Each process's return code and output, waiting at most `timeout` seconds for them all (those
    still running then are killed and report None)."""
    deadline = time.monotonic() + timeout
    for r in runs:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    codes = [r.proc.poll() for r in runs]
    outs = [(rc, r.log.read_text()) for rc, r in zip(codes, runs)]
    stop(runs)
    return outs


def stop(runs: list[Run]) -> None:
    """Kills whichever still runs and removes the logs."""
    for r in runs:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait(timeout=30)
        r.log.unlink(missing_ok=True)

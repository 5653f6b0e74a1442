"""Run the kernel tests under the Triton interpreter, in their own process (Triton reads
TRITON_INTERPRET at import): this is how CI tests the Triton kernels, not their references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already inside the interpreter process")
def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    # the interpreter's tl.dot is a numpy matmul of one tile: on a loaded 2-core machine,
    # OpenBLAS's worker threads made one 64x128x128 tile take ~20 ms instead of ~0.1 ms (measured)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "test_interp_cases.py")]
    proc = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter tests failed (rc={proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail

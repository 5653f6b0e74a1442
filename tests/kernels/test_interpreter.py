"""Run the kernel tests under the Triton interpreter, in their own processes (Triton reads
TRITON_INTERPRET at import): this is how CI tests the Triton kernels, not their references.
The processes start when this test is collected (tests/conftest.py, `interpreter_run`); the
test runs last and waits for them."""

from __future__ import annotations

import os

import pytest

from . import interpreter_run


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already inside the interpreter process")
def test_triton_kernels_under_interpreter(request):
    runs = request.config.stash.get(interpreter_run.STASH, None) or interpreter_run.start(niceness=0)
    request.config.stash[interpreter_run.STASH] = []
    for rc, out in interpreter_run.finish(runs, timeout=540):
        tail = out[-6000:]
        assert rc is not None, f"interpreter tests still running after 540 s (killed):\n{tail}"
        assert rc == 0, f"interpreter tests failed (rc={rc}):\n{tail}"
        assert " passed" in out and "skipped" not in out.strip().splitlines()[-1], tail

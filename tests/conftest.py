import os

import pytest

# Loopback-only machines: UCX must use the loopback device (tests that need UCX rely on it).
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only a selected test starts them
def pytest_collection_modifyitems(config, items):
    # the Triton interpreter's processes start now, niced, beside the rest of the suite; their test
    # runs last (tests/kernels/interpreter_run.py says why)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    from tests.kernels import interpreter_run

    hit = [it for it in items if it.nodeid.endswith(interpreter_run.NODE)]
    if not hit:
        return
    items.remove(hit[0])
    items.append(hit[0])
    config.stash[interpreter_run.STASH] = interpreter_run.start()


def pytest_unconfigure(config):
    from tests.kernels import interpreter_run

    interpreter_run.stop(config.stash.get(interpreter_run.STASH, []))

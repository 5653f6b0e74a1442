"""kernels/compile_watch.py without a GPU: the hook it installs counts misses inside and outside
`warming()`, logs the latter, chains the hook it replaced and restores it."""

from __future__ import annotations

import logging
import threading

import pytest

triton = pytest.importorskip("triton")

from glm53.kernels.compile_watch import AFTER_WARMUP, CompileWatch  # noqa: E402


class _Fn:
    module, name = "glm53.kernels.x", "_kernel"


def test_counts_warming_and_after(caplog):
    from triton import knobs

    seen = []
    prev = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["repr"])
    w = CompileWatch()
    try:
        w.install()
        w.install()  # idempotent
        hook = knobs.runtime.jit_cache_hook
        with w.warming():
            assert hook(fn=_Fn(), repr="a") is None
        other = threading.Thread(target=lambda: hook(fn=_Fn(), repr="b"))  # another thread is not warming
        with w.warming():
            other.start()
            other.join()
        with caplog.at_level(logging.WARNING):
            hook(fn=_Fn(), repr="c")
        assert w.count(warming=True) == 1 and w.count(warming=False) == 2 and w.count() == 3
        assert [e.repr for e in w.after_warmup()] == ["b", "c"]
        assert any(AFTER_WARMUP in r.message and "glm53.kernels.x._kernel" in r.message for r in caplog.records)
        assert seen == ["a", "b", "c"]  # the replaced hook still sees every miss
    finally:
        w.uninstall()
        restored = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = prev
    assert restored is not None and restored is not w._hook

"""A colocated pair's CUDA streams (engine/colocate.py): prefill moves between its green context's
stream and the whole GPU as decode gets busy or idle, and a prompt's work stays in order across a
switch. Skipped without a GPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from glm53.server.engine.colocate import GpuShare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (green contexts)"),
]


def test_prefill_stream_follows_decode_and_keeps_order():
    busy = {"v": True}
    share = GpuShare(torch.device("cuda:0"), 32, lambda: busy["v"])
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    out = {}

    def prefill_thread():
        share.prefill_step()  # decode busy: the green context's stream
        out["first"] = torch.cuda.current_stream()
        torch.cuda._sleep(100_000_000)  # ~50 ms of queued work before the write
        x.fill_(3.0)
        busy["v"] = False
        share.prefill_step()  # decode idle: the whole GPU, ordered after the queued write
        out["second"] = torch.cuda.current_stream()
        out["read"] = x.clone()
        out["read"].add_(1)
        torch.cuda.current_stream().synchronize()

    t = threading.Thread(target=prefill_thread)
    t.start()
    t.join(60)
    assert out["first"] == share.narrow and out["second"] == share.full
    assert torch.cuda.current_stream() != share.full  # the choice is the prefill thread's alone
    assert torch.equal(out["read"], torch.full_like(x, 4.0))
    assert share.steps == {"narrow": 1, "full": 1}


def test_decode_is_not_held_behind_a_narrow_prefill():
    """With prefill's long kernel on the green context, work on decode's stream still finishes
    at once (it would wait behind it on one stream of the whole GPU)."""
    share = GpuShare(torch.device("cuda:0"), 32, lambda: True)
    with torch.cuda.stream(share.decode):  # load the kernels first: a first launch may wait for the GPU
        y = torch.randn(4096, 4096, device="cuda")
        (y @ y).sum().item()
    torch.cuda.synchronize()
    with torch.cuda.stream(share.narrow):
        torch.cuda._sleep(2_000_000_000)  # ~1 s on the prefill SMs
        done = torch.cuda.Event()
        done.record()
    with torch.cuda.stream(share.decode):
        t = time.perf_counter()
        (y @ y).sum().item()
        waited = time.perf_counter() - t
    assert not done.query() and waited < 0.5, waited
    done.synchronize()

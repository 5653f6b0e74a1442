"""models/readback.py on a GPU: the same values as `.cpu()`, in pinned memory, for the stream's
latest result (the copy is ordered after work queued on the current stream)."""

from __future__ import annotations

import pytest
import torch

from glm53.models.readback import readback

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_readback_matches_cpu_copy_after_queued_work():
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(257, 33, device="cuda", generator=g)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # the result below is computed well after the call returns
        y = (x * 3).argmax(dim=-1)
        host = readback(y)
    torch.cuda.synchronize()
    assert host.is_pinned() and host.device.type == "cpu"
    assert torch.equal(host, y.cpu())


def test_readback_of_cpu_tensor_is_itself():
    t = torch.arange(5)
    assert readback(t) is t

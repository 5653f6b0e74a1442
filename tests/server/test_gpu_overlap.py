"""The overlapped decode loop's launch on CUDA (engine/overlap.py): sampling a mixed batch of
greedy and unseeded sampled rows and queueing the copy back must not wait for the GPU, and the
tokens it returns obey each row's filters. Skipped without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm53.server.engine.overlap import InflightStep
from glm53.server.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (asynchronous copies, sync debug mode)"),
]


def test_sampled_launch_syncs_nothing_and_obeys_the_filters():
    g = torch.Generator(device="cuda").manual_seed(7)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.3, min_p=0.2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3, top_p=0.9)]
    batch = [SimpleNamespace(params=p) for p in params]
    for _ in range(20):
        logits = torch.randn(len(params), 4160, device="cuda", generator=g) * 3
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = InflightStep.launch(batch, logits)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        tokens = step.result()
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        top = logits.argsort(dim=-1, descending=True).cpu()
        assert tokens[0] == int(top[0, 0]) and tokens[4] == int(top[4, 0])
        assert tokens[1] in top[1, :5].tolist()
        assert tokens[5] in top[5, :3].tolist()
        # top_p 0.5 at temperature 1: the token lies in the smallest prefix holding half the mass
        cum = probs[2][top[2]].cumsum(0)
        assert tokens[2] in top[2, : int((cum < 0.5).sum()) + 1].tolist()
        # min_p 0.2 at temperature 1.3: at least 0.2 of the most likely token's probability
        p13 = torch.softmax(logits[3].float().cpu() / 1.3, dim=-1)
        assert p13[tokens[3]] >= 0.2 * p13.max() - 1e-6

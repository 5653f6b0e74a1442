"""The rank-process worker path on CUDA: one rank through `ProcessWorkers` (NCCL process group for
the model, gloo for commands) against the same rank in-process (`LocalWorkers`), on the embedded
model. Two ranks cannot share one GPU under NCCL, so on a one-GPU machine this is as far as the
NCCL path goes; several GPUs are the multi-GPU run's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from glm53.models import GlmConfig, PageAllocator, SeqChunk
from glm53.server.embedded_model import ensure_embedded_model
from glm53.server.engine.group import LocalWorkers
from glm53.server.engine.processes import ProcessWorkers
from glm53.server.engine.worker import RankSpec
from glm53.support.ports import free_ports
from glm53.transport import TransportConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)"),
]


def test_one_rank_through_processes_on_nccl_equals_in_process(tmp_path):
    model_dir = ensure_embedded_model(tmp_path)
    layers = range(GlmConfig.from_dir(model_dir).num_hidden_layers)
    spec = RankSpec(role="decode", instance="d0", model_path=str(model_dir), device="cuda:0", dtype="float32",
                    layers=layers, page_size=16, num_pages=64, max_total_tokens=None, mem_fraction_static=0.85,
                    transport=TransportConfig())
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (40, 150)]  # 150 > index_topk
    outs = []
    for make in (lambda: LocalWorkers([spec]),
                 lambda: ProcessWorkers([spec], timeout_s=60, port=free_ports(1)[0])):
        workers = make()
        try:
            allocator = PageAllocator(workers.num_pages)
            pages = [allocator.alloc(workers.pages_needed(len(p) + 1)) for p in prompts]
            chunks = [SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)]
            first = workers.forward(chunks)
            workers.sync()
            nxt = [int(lg[-1].argmax()) for lg in first]
            step = workers.forward([SeqChunk([t], len(p), pg) for t, p, pg in zip(nxt, prompts, pages)])
            outs.append([torch.cat(first).cpu(), torch.cat(step).cpu()])
        finally:
            workers.close()
    for a, b in zip(*outs):
        assert torch.equal(a, b), float((a - b).abs().max())

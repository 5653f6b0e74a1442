"""The model core on CUDA, where the DSA ops run their Triton kernels, against the same model on
the CPU torch-reference path. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk
from glm53.server.offline import greedy_generate
from glm53.support.oracle import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels compiled)"),
]


def test_cuda_triton_path_matches_cpu_reference(tmp_path):
    make_checkpoint(tmp_path, seed=11, index_topk_freq=2, index_skip_topk_offset=2)
    cpu = ModelRunner.from_dir(tmp_path, page_size=16, num_pages=64, progress=False)
    gpu = ModelRunner.from_dir(tmp_path, page_size=16, num_pages=64, device="cuda", dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 158, (200,), generator=g).tolist()  # 25x index_topk: sparse
    outs = []
    for r in (cpu, gpu):
        allocator = PageAllocator(64)
        pages = allocator.alloc(r.pages_needed(len(prompt)))
        outs.append(r.forward([SeqChunk(prompt, 0, pages, all_logits=True)])[0].cpu())
        allocator.free(pages)
    rel = float((outs[1] - outs[0]).norm() / outs[0].norm())
    print(f"prefill logits rel err CUDA (Triton, fp32 IEEE dots) vs CPU reference: {rel:.2e}")
    assert rel <= 1e-4
    # Greedy decode, batch of 3 ragged prompts, through the Triton top-k / indexer / sparse MLA.
    prompts = [torch.randint(0, 158, (n,), generator=g).tolist() for n in (30, 90, 170)]
    a = greedy_generate(cpu, PageAllocator(64), prompts, 16, ignore_eos=True)
    b = greedy_generate(gpu, PageAllocator(64), prompts, 16, ignore_eos=True)
    assert a == b

"""The dispatch rule and the CPU-side helpers (no Triton kernels run here)."""

from __future__ import annotations

import os

import pytest
import torch

from glm53.kernels import dispatch, index_cache_fp8
from glm53.kernels.topk import dsa_topk, dsa_topk_reference


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter process")
def test_cpu_tensors_take_the_reference():
    assert not dispatch.use_triton(torch.empty(1))
    x = torch.randn(2, 3000)
    lens = torch.tensor([3000, 10], dtype=torch.int32)
    assert torch.equal(dsa_topk(x, lens, 256), dsa_topk_reference(x, lens, 256))


def test_fp8_index_cache_layout_roundtrip():
    torch.manual_seed(0)
    page_size, D = 64, 128
    pool = index_cache_fp8.alloc_pool(6, 3, page_size, D)
    assert pool.shape == (6, 3, 8448)  # 64 tokens x 132 B
    view = pool[:, 2]
    k = torch.randn(10, D) * 3
    slots = torch.tensor([0, 5, 63, 64, 100, 200, 255, 256, 300, 383])
    index_cache_fp8.store(view, slots, k)
    keys, scales = index_cache_fp8.split_view(view)
    assert keys.shape == (6, page_size, D) and scales.shape == (6, page_size)
    # scale: a power of two >= amax/448; the bytes sit where the layout says
    s = scales[slots // page_size, slots % page_size]
    assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))
    assert torch.all(s * 448 >= k.abs().amax(-1))
    raw = pool[1, 2, 64 * 128 + 0 * 4 : 64 * 128 + 4].view(torch.float32)  # slot 64: page 1, token 0
    assert raw.item() == s[3].item()
    deq = index_cache_fp8.dequantize(view)[slots // page_size, slots % page_size]
    assert ((deq - k).norm() / k.norm()).item() < 0.05
    # other layers untouched
    assert torch.count_nonzero(pool[:, :2]) == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter process")
def test_moe_cpu_tensors_take_the_reference():
    from glm53.kernels.moe import moe_experts, moe_experts_reference

    from .cases import moe_inputs

    torch.manual_seed(1)
    inputs = moe_inputs(9, 32, 16, 6, 3, torch.float32, n_empty=1)
    assert torch.equal(moe_experts(*inputs), moe_experts_reference(*inputs))

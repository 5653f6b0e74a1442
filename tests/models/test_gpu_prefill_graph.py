"""CUDA graphs of short prompt chunks (models/prefill_graph.py): replays against the eager forward
(the last logits and every pool's KV, the draft's context included), no host sync in a replay's
launch, chunks of a continued prompt. Skipped without a GPU. (The static forward on CPU:
test_prefill_graph.py; the embedded pair end to end: test_gpu_spec_graphs.py.)"""

from __future__ import annotations

import pytest
import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk
from glm53.models.graph import GraphConfig
from glm53.support.oracle import make_checkpoint
from tests.models.draft_oracle import make_draft_checkpoint
from tests.models.test_prefill_graph import _kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, Triton kernels)"),
]

PS, PAGES = 16, 96


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graph_replay_equals_eager_and_syncs_nothing(tmp_path, dtype):
    make_checkpoint(tmp_path / "target", seed=81, index_topk_freq=2, index_skip_topk_offset=2)
    make_draft_checkpoint(tmp_path / "draft", tmp_path / "target", seed=82, target_layer_ids=[1, 2, 4], block_size=4)
    r = ModelRunner.from_dir(tmp_path / "target", page_size=PS, num_pages=1, device="cuda", dtype=dtype,
                             progress=False, draft_dir=tmp_path / "draft")
    runner = ModelRunner(r.model, num_pages=PAGES, page_size=PS, device="cuda", draft=r.draft,
                         graphs=GraphConfig(max_bs=0, max_context=600, prefill_tokens=128))
    graphs = runner.prefill_graphs
    assert runner.graphs is None and runner.spec_graphs is None and graphs.sizes == (32, 64, 128)
    assert len(graphs.graphs) == len(graphs.sizes) * len(graphs.widths)
    g = torch.Generator().manual_seed(5)
    alloc = PageAllocator(PAGES)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for cuts in ([200], [97], [128, 128, 31], [5, 60]):  # past index_topk (8): the sparse path
        n = sum(cuts)
        prompt = torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist()
        mine, ref = alloc.alloc(runner.pages_needed(n)), alloc.alloc(runner.pages_needed(n))
        start = 0
        for c in cuts:
            chunk = prompt[start : start + c]
            held = graphs.bucket([SeqChunk(chunk, start, mine)]) is not None
            assert held == (c <= 128)
            replays = graphs.replays
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = runner.forward([SeqChunk(chunk, start, mine)])[0]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert graphs.replays == replays + held
            runner.prefill_graphs = None
            try:
                want = runner.forward([SeqChunk(chunk, start, ref)])[0]
            finally:
                runner.prefill_graphs = graphs
            rel = float((got - want).norm() / want.norm())
            assert rel <= tol, rel
            if dtype == torch.float32:
                assert int(got.argmax()) == int(want.argmax())
            start += c
        a, b = _kv(runner, mine, n), _kv(runner, ref, n)
        for name in a:
            rel = float((a[name].float() - b[name].float()).norm() / b[name].float().norm())
            assert rel <= tol, (name, rel)
        alloc.free(mine)
        alloc.free(ref)


def test_prefill_graph_captures_fp8_weights_and_fp8_kv(tmp_path, monkeypatch):
    """A block-FP8 checkpoint served FP8 (w8a8 products with quantizing producers at these
    sizes, cuBLAS's from 128 rows) with the FP8 KV cache: the prefill graphs capture and replay
    what the eager forward computes. The eager forward sees n tokens, a graph its bucket, and the
    MoE's tiles follow the count: another tiling rounds some e4m3 h elements to the other
    neighbour, which this random model amplifies to ~10 % of its logits (n = 40: the decode tiles
    eager, the prefill tiles in the 64-token graph). One tiling for both, so that the test
    compares the capture with eager, not two tilings."""
    from glm53.kernels import moe_fp8_triton
    from glm53.models.kv_cache import FP8
    from glm53.support.oracle import FP8_WIDTHS, quantise_fp8_

    tiles = moe_fp8_triton.default_fp8_config
    monkeypatch.setattr(moe_fp8_triton, "default_fp8_config", lambda n_pairs, *a, **kw: tiles(1 << 20, *a, **kw))

    make_checkpoint(tmp_path / "ckpt", seed=83, **FP8_WIDTHS)
    quantise_fp8_(tmp_path / "ckpt", block=128)
    r = ModelRunner.from_dir(tmp_path / "ckpt", page_size=PS, num_pages=1, device="cuda", dtype=torch.bfloat16,
                             progress=False, fp8=True)
    runner = ModelRunner(r.model, num_pages=PAGES, page_size=PS, device="cuda", kv_dtype=FP8,
                         graphs=GraphConfig(max_bs=0, max_context=600, prefill_tokens=256))
    graphs = runner.prefill_graphs
    g = torch.Generator().manual_seed(6)
    alloc = PageAllocator(PAGES)
    for n in (40, 150, 256):
        prompt = torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist()
        mine, ref = alloc.alloc(runner.pages_needed(n)), alloc.alloc(runner.pages_needed(n))
        replays = graphs.replays
        got = runner.forward([SeqChunk(prompt, 0, mine)])[0]
        assert graphs.replays == replays + 1
        runner.prefill_graphs = None
        try:
            want = runner.forward([SeqChunk(prompt, 0, ref)])[0]
        finally:
            runner.prefill_graphs = graphs
        rel = float((got - want).norm() / want.norm())
        assert rel <= 3e-2, (n, rel)
        alloc.free(mine)
        alloc.free(ref)

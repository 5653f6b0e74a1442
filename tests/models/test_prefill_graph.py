"""Prefill graphs' static forward (models/prefill_graph.py) on CPU tensors (`capture=False`: the
forward the graphs hold, run eagerly on the static buffers): for prompts in one chunk and in
several (a later chunk over the KV of the earlier ones), longer than index_topk so the sparse path
runs, the last token's logits and every pool's KV (the target's, the indexer's and the draft's
context) match the eager forward's on other pages; padding tokens write only the padding page;
what no graph holds is left to the eager path. (Capture and replay: test_gpu_prefill_graph.py.)"""

from __future__ import annotations

import pytest
import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk
from glm53.models.prefill_graph import PrefillGraphs, token_buckets
from glm53.support.oracle import make_checkpoint
from tests.models.draft_oracle import make_draft_checkpoint

PS, PAGES = 4, 120  # the runner holds PAGES + 1 pages: page PAGES is the padding page


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill_graph")
    make_checkpoint(root / "target", seed=71, index_topk_freq=2, index_skip_topk_offset=2)
    make_draft_checkpoint(root / "draft", root / "target", seed=72, target_layer_ids=[1, 2, 4], block_size=4)
    # fp32 draft products: the static and eager forwards' context rows differ in their last bits,
    # which bf16 products (`cpu_bf16`, a CPU-only path; graphs are CUDA's) would turn into bf16 ones
    r = ModelRunner.from_dir(root / "target", page_size=PS, num_pages=PAGES + 1, progress=False,
                             draft_dir=root / "draft", draft_cpu_bf16=False)
    r.prefill_graphs = PrefillGraphs(r, 64, 200, pad_page=PAGES, capture=False)
    return r


def _kv(runner, pages, n):
    """Every pool's KV of positions 0 .. n − 1 (a pool is [page, ..., slot in the page, dim])."""
    return {name: pool.tensor[pages].movedim(-2, 1).flatten(0, 1)[:n].clone() for name, pool in runner.pools}


def test_static_prefill_equals_eager(runner):
    graphs = runner.prefill_graphs
    assert token_buckets(64) == (32, 64) and token_buckets(40) == (32, 40)
    g = torch.Generator().manual_seed(3)
    alloc = PageAllocator(PAGES)
    for _, pool in runner.pools:  # pages no request holds must stay as they are (zero)
        pool.tensor.zero_()
    touched: set[int] = set()
    for cuts in ([37], [20, 41], [2, 64, 9]):  # chunk lengths: one chunk, then continued prompts
        n = sum(cuts)
        prompt = torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist()
        eager_pages, static_pages = alloc.alloc(runner.pages_needed(n + 5)), alloc.alloc(runner.pages_needed(n + 5))
        touched.update(eager_pages + static_pages)
        start = 0
        for c in cuts:
            chunk = prompt[start : start + c]
            key = graphs.bucket([SeqChunk(chunk, start, static_pages)])
            assert key is not None and key[0] >= c
            replays = graphs.replays
            got = runner.forward([SeqChunk(chunk, start, static_pages)])
            assert graphs.replays == replays + 1
            runner.prefill_graphs = None
            try:
                want = runner.forward([SeqChunk(chunk, start, eager_pages)])
            finally:
                runner.prefill_graphs = graphs
            assert got[0].shape == want[0].shape == (1, runner.cfg.vocab_size)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
            start += c
        kv_e, kv_s = _kv(runner, eager_pages, n), _kv(runner, static_pages, n)
        for name in kv_e:
            torch.testing.assert_close(kv_s[name], kv_e[name], rtol=1e-4, atol=1e-4, msg=name)
        alloc.free(eager_pages)
        alloc.free(static_pages)
    never = sorted(set(range(PAGES)) - touched)
    assert never
    for name, pool in runner.pools:  # nothing but the requests' pages and the padding page written
        assert not pool.tensor[never].any(), name


def test_bucket_leaves_the_rest_to_the_eager_path(runner):
    graphs = runner.prefill_graphs
    pages = list(range(60))
    assert graphs.bucket([SeqChunk([1] * 65, 0, pages)]) is None  # past the largest bucket
    assert graphs.bucket([SeqChunk([1], 10, pages)]) is None  # one token: decode's
    assert graphs.bucket([SeqChunk([1] * 8, 0, pages, all_logits=True)]) is None
    assert graphs.bucket([SeqChunk([1] * 8, 0, pages)] * 2) is None  # two requests
    assert graphs.bucket([SeqChunk([1] * 8, 196, pages)]) is None  # past the graphs' context (200)
    assert graphs.bucket([SeqChunk([1] * 8, 0, [3])]) is None  # pages cannot hold it: the eager error
    assert graphs.bucket([SeqChunk([1] * 8, 0, pages[:2])]) == (32, graphs.widths[0])

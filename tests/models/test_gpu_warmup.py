"""The start-up warm-up on a GPU: after `warm_up`, random prefill, decode and verify batches
within its bounds compile nothing (kernels/compile_watch.py counts Triton's JIT cache misses).
Skipped without a GPU; TRITON_CACHE_DIR may be fresh or not (a load from it counts too)."""

from __future__ import annotations

import random

import pytest
import torch

from glm53.kernels.compile_watch import WATCH
from glm53.models import ModelRunner, SeqChunk
from glm53.models.warmup import warm_up
from glm53.support.oracle import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton compiles)"),
]

PS, PAGES, MAX_TOKENS, MAX_CONTEXT = 16, 96, 80, 1200


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_compiles_after_warmup(tmp_path, dtype):
    make_checkpoint(tmp_path, seed=5, index_topk_freq=2, index_skip_topk_offset=2)
    runner = ModelRunner.from_dir(tmp_path, page_size=PS, num_pages=PAGES, device="cuda", dtype=dtype, progress=False)
    report = warm_up(runner, MAX_TOKENS, MAX_CONTEXT)
    assert report is not None and report.shapes > 0
    before = len(WATCH.after_warmup())
    rng = random.Random(7)
    vocab = runner.cfg.vocab_size
    for _ in range(40):
        chunks, left = [], rng.randint(1, MAX_TOKENS)
        while left:
            n = rng.randint(1, left)
            end = rng.randint(n, MAX_CONTEXT)
            pages = list(range(-(-end // PS) + rng.randint(0, 3)))  # page tables of any width
            chunks.append(SeqChunk([rng.randrange(1, vocab) for _ in range(n)], end - n, pages[:PAGES],
                                   all_logits=rng.random() < 0.3))
            left -= n
        runner.forward(chunks)
    torch.cuda.synchronize()
    after = WATCH.after_warmup()[before:]
    assert not after, f"{len(after)} Triton compiles after warm-up: {[e.name for e in after]}"

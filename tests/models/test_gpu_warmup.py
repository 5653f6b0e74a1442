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
from glm53.support.oracle import FP8_WIDTHS, make_checkpoint, quantise_fp8_

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton compiles)"),
]

PS, PAGES, MAX_TOKENS, MAX_CONTEXT = 16, 96, 80, 1200


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
def test_no_compiles_after_warmup(tmp_path, dtype):
    fp8 = dtype == "fp8"
    if fp8:
        # block-FP8 linears with v_head_dim 128: the W_UV product writes o_proj's rows and, at up
        # to fp8_act.UV_SPLITS_MAX_ROWS rows, combines sparse MLA's splits (top-1024: 16 a token)
        make_checkpoint(tmp_path, seed=5, **{**FP8_WIDTHS, "v_head_dim": 128, "index_topk": 1024})
        quantise_fp8_(tmp_path, block=128)
    else:
        make_checkpoint(tmp_path, seed=5, index_topk_freq=2, index_skip_topk_offset=2)
    runner = ModelRunner.from_dir(tmp_path, page_size=PS, num_pages=PAGES, device="cuda",
                                  dtype=torch.bfloat16 if fp8 else dtype, progress=False, fp8=fp8)
    report = warm_up(runner, MAX_TOKENS, MAX_CONTEXT)
    assert report is not None and report.shapes > 0
    before = len(WATCH.after_warmup())
    rng = random.Random(7)
    vocab = runner.cfg.vocab_size
    for i in range(60):
        # every third batch a few tokens (the decode sizes, where launches pick tiles by count)
        chunks, left = [], rng.randint(1, MAX_TOKENS if i % 3 else 6)
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

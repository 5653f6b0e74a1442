"""The start-up warm-up (models/warmup.py) on the CPU: a no-op for serving there, and, forced,
every shape it lists runs through the tiny model (the synthetic batches are valid batches)."""

from __future__ import annotations

import pytest

from glm53.kernels import variants
from glm53.models import ModelRunner
from glm53.models.warmup import serve_shape, synthetic_chunks, warm_up
from glm53.server.embedded_model import ensure_embedded_model


@pytest.fixture(scope="module")
def runner():
    return ModelRunner.from_dir(ensure_embedded_model(), page_size=16, num_pages=64, device="cpu", progress=False)


def test_cpu_warmup_is_a_noop(runner):
    assert warm_up(runner, 64, 1000) is None


def test_forced_warmup_runs_every_shape(runner):
    shape = serve_shape(runner, 48, 700)
    assert shape.n_experts > 0 and shape.heads == runner.cfg.num_attention_heads
    want = variants.reachable(shape)
    report = warm_up(runner, 48, 700, force=True)
    assert report.shapes == len(variants.warmup_shapes(shape, want)) and report.variants == variants.count_variants(want)
    assert report.compiled == 0  # nothing compiles on the CPU


def test_synthetic_chunks_fill_the_width():
    import torch

    gen = torch.Generator().manual_seed(0)
    for n, width in [(1, 16), (5, 16), (40, 16), (33, 48), (7, 704)]:
        chunks = synthetic_chunks(n, width, 690, 16, 100, gen)
        assert sum(len(c.token_ids) for c in chunks) == n
        ends = [c.start_pos + len(c.token_ids) for c in chunks]
        assert variants.logits_width(max(ends)) == min(width, variants.logits_width(690))
        assert all(-(-e // 16) <= len(c.page_table) for c, e in zip(chunks, ends))

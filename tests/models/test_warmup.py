"""The start-up warm-up (models/warmup.py) on the CPU: a no-op for serving there, and, forced,
every shape it lists runs through the tiny model (the synthetic batches are valid batches)."""

from __future__ import annotations

import pytest

from glm53.kernels import variants
from glm53.models import ModelRunner
from glm53.models.draft import DraftBlock
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


def test_warmup_launches_every_draft_attention_variant_serving_reaches(monkeypatch):
    """The DFlash draft's paged attention, its launches recorded instead of run (as the GPU runs
    them: the Triton path): every variant the serving loop's drafting forwards launch — the
    graphs' (batch, width) buckets at two verify widths, and eager steps of any batch, block and
    context — is one that the forced warm-up launched."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("records real JIT launches (not the interpreter's)")
    import torch

    from glm53.kernels import draft_attention as da, draft_attention_triton as dat
    from glm53.models import draft as draft_mod
    from glm53.models.graph import batch_buckets, width_buckets
    from glm53.models.spec_state import SpecState
    from glm53.server.embedded_model import ensure_embedded_draft
    from tests.kernels.test_variants import _signature

    log: set = set()
    for fn in (dat._draft_attn_kernel, dat._combine_kernel):
        monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, _fn=fn, **kw: log.add(_signature(_fn, a, kw)))
    monkeypatch.setattr(da, "use_triton", lambda *a: True)  # the launcher, not the CPU reference
    monkeypatch.setattr(draft_mod, "use_triton", lambda *a: True)  # the layers' path, not the fused CPU one
    rows, ctx = 4, 700
    run = ModelRunner.from_dir(ensure_embedded_model(), draft_dir=ensure_embedded_draft(), page_size=16, num_pages=64,
                               device="cpu", progress=False, dtype=torch.bfloat16)
    draft, model, K = run.draft, run.model, run.draft.cfg.block_size
    report = warm_up(run, rows * K, ctx, force=True)
    warmed, served = set(log), set()
    assert warmed and report.compiled == 0
    pages = -(-ctx // 16)
    for k in (4, K):  # a captured step's drafting forward (models/spec_graph.spec_forward)
        st = SpecState(rows, pages, 16, 63, k, draft.cfg.mask_token_id, model.cfg.max_position_embeddings,
                       torch.device("cpu"))
        for width in width_buckets(pages, 16):
            for bs in batch_buckets(rows):
                log.clear()
                d = st.draft_inputs(bs, width)
                draft.block_hidden(model, d.ids, d.positions, draft.paged_context(d.table, d.mask, run.pools))
                served |= log
    for R, B, start in [(1, 2, 1), (1, K, 5), (1, 3, 17), (2, 7, 40), (3, K, 333), (4, 5, 680), (4, K, 100),
                        (1, K, 699), (3, 2, 256), (2, 11, 31)]:  # eager steps (engine: sampled, no graph)
        log.clear()
        blocks = [DraftBlock(last_token=1, start_pos=start, page_table=list(range(-(-(start + B) // 16))),
                             block_size=B) for _ in range(R)]
        draft.draft_block(model, blocks, run.pools)
        served |= log
    assert served and served <= warmed, served - warmed

"""Pipeline- and tensor-parallel prefill into a real decode rank, through real processes and UCX
(tests/pd_harness.py: the prefill ranks as gloo rank processes, the decode rank in its own
process). A prompt prefilled by pp = 1, 2, 3 stages (consecutive chunks pipelined as
micro-batches, each stage writing its own layers' pages) must leave decode byte-identical to
pp = 1 — target latent KV, indexer keys and, with DFlash, the draft KV (whose context the stages
project partially and the last stage finishes) — with the same first token. The embedded model's
6 layers with index sharing (full, full, shared, full, shared, full) and draft features of layers
1 and 3 put a feature on the last layer of a stage and a shared layer right after a boundary.

Every prefill rank, of every stage and of tp = 2, must post exactly the descriptors
`transport.mapping` plans for it (replicated buffers spread over the source ranks, page runs
coalesced); a follower rank's counts reach rank 0 with its terminal state."""

from __future__ import annotations

import pytest
import torch

from glm53.models import write_random_draft
from glm53.support.pd_harness import prefill_into_decode

CHUNK = 24


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, model_dir):
    return write_random_draft(tmp_path_factory.mktemp("draft"), model_dir, seed=4, n_layers=2, block_size=4)


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(12)
    return torch.randint(10, 4000, (150,), generator=g).tolist()  # > index_topk (64): sparse


def test_pp_stages_fill_decode_exactly_like_one_stage(tmp_path, model_dir, draft_dir, prompt):
    """With DFlash on: the target pools and the draft KV in one run (pp=2 in the e2e tests runs
    without the draft)."""
    ref = prefill_into_decode(model_dir, draft_dir, prompt, chunk=CHUNK, workdir=tmp_path)
    assert set(ref.pools) == {"latent", "index_k", "draft_kv"}
    assert all(bool(t.abs().sum() > 0) for t in ref.pools.values())  # the reference really was written
    assert ref.decode_first == ref.first and ref.descs == ref.predicted
    for pp in (2, 3):  # pp = 3 (layers 0-1, 2-3, 4-5): features on stage ends, a shared layer after a boundary
        got = prefill_into_decode(model_dir, draft_dir, prompt, pp=pp, chunk=CHUNK, workdir=tmp_path)
        assert got.first == got.decode_first == ref.first, pp
        assert got.descs == got.predicted and len(got.descs) == pp, (pp, got.descs, got.predicted)
        assert set(got.pools) == set(ref.pools)
        for name, t in ref.pools.items():
            assert torch.equal(got.pools[name], t), (pp, name, float((got.pools[name] - t).abs().max()))


def test_tp_ranks_post_the_descriptors_the_mapping_plans(tmp_path, model_dir, draft_dir, prompt):
    got = prefill_into_decode(model_dir, draft_dir, prompt, tp=2, chunk=CHUNK, workdir=tmp_path)
    assert got.first == got.decode_first
    assert got.descs == got.predicted and len(got.descs) == 2 and min(got.descs) > 0, (got.descs, got.predicted)
    assert all(bool(t.abs().sum() > 0) for t in got.pools.values())

"""Pipeline-parallel prefill end to end through real processes: prefill with pp stages (gloo rank
processes, micro-batches pipelined across stages, each stage sending its own layers' KV to
decode), decode tp=1; greedy output equals the one-process `glm53-serve generate` token for
token, with DFlash off and on (the draft's context projected partially on every stage)."""

from __future__ import annotations

import pytest

from glm53.models import write_random_draft
from glm53.server.embedded_model import ensure_embedded_model
from tests.e2e.cluster import Cluster
from tests.e2e.test_pd_serving import GREEDY_PROMPTS, offline_greedy, served_greedy, wait_pages_free

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def target_dir(model_cache):
    return ensure_embedded_model(model_cache)


@pytest.fixture(scope="module")
def offline(target_dir):
    return offline_greedy(target_dir, GREEDY_PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir):
    # Feature layers 1 and 3 of 6: with pp=2 (layers 0-2 | 3-5) they come from different stages;
    # with pp=3 (0-1 | 2-3 | 4-5) each is the last layer of its stage.
    return write_random_draft(tmp_path_factory.mktemp("draft"), target_dir, seed=9, n_layers=2, block_size=4)


@pytest.mark.parametrize("pp, tp, dflash", [(2, 1, False), (3, 1, True), (2, 2, True)])
def test_pp_prefill_greedy_equals_offline(tmp_path_factory, model_cache, draft_dir, offline, pp, tp, dflash):
    spec = {"algorithm": "DFLASH", "draft_model_path": str(draft_dir)} if dflash else None
    c = Cluster(tmp_path_factory.mktemp(f"pp{pp}tp{tp}"), model_cache, prefill_pp=pp, prefill_tp=tp,
                speculative=spec).start()
    try:
        assert served_greedy(c, GREEDY_PROMPTS, NEW_TOKENS) == offline
        wait_pages_free(c)
    finally:
        c.stop()

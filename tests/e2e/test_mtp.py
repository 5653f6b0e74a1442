"""GLM-5's own MTP layer as the draft (NEXTN) end to end: prefill with pp=2 stages (the last one
runs the MTP layer over the prompt and sends its KV with the target's), decode with tp=2 (every
rank drafts the same chain; the request keys travel in the step delta). Greedy output equals the
one-process non-speculative `glm53-serve generate` token for token, with the MTP KV sent and with
it opted out (draft_kv_transfer: false); the shipped tiny layer accepts drafts (spec_verify_ct
below the tokens generated)."""

from __future__ import annotations

import httpx
import pytest

from glm53.models import GlmConfig
from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.cluster import Cluster
from tests.e2e.served import GREEDY_PROMPTS, offline_greedy, wait_pages_free

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target_dir(model_cache):
    d = ensure_embedded_model(model_cache)
    if not GlmConfig.from_dir(d).num_nextn_predict_layers:
        pytest.skip("the embedded checkpoint has no MTP layer")
    return d


@pytest.mark.parametrize("transfer", [True, False])
def test_nextn_pp_prefill_tp_decode_greedy_equals_offline(tmp_path_factory, model_cache, target_dir, transfer):
    offline = offline_greedy(target_dir, GREEDY_PROMPTS, NEW_TOKENS)
    spec = {"algorithm": "NEXTN", "num_steps": 3, "draft_kv_transfer": transfer}
    c = Cluster(tmp_path_factory.mktemp(f"mtp{int(transfer)}"), model_cache, prefill_pp=2, decode_tp=2,
                speculative=spec).start()
    try:
        verifies = 0
        for p, want in zip(GREEDY_PROMPTS, offline):
            r = httpx.post(f"{c.url}/generate", timeout=180, json={
                "input_ids": p, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                    "ignore_eos": True}})
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want
            verifies += r.json()["meta_info"]["spec_verify_ct"]
        # One verify per decode step; drafts accepted make them fewer than the tokens decoded.
        assert verifies < len(GREEDY_PROMPTS) * (NEW_TOKENS - 1), verifies
        info = httpx.get(f"{c.url}/get_server_info", timeout=30).json()
        assert "NEXTN" in str(info), info
        wait_pages_free(c)
    finally:
        c.stop()

"""GLM-5's own MTP layer as the draft (NEXTN) end to end: prefill with pp=2 stages (the last one
runs the MTP layer over the prompt and sends its KV with the target's), decode with tp=2 (every
rank drafts the same chain; the request keys travel in the step delta). Greedy output equals the
one-process non-speculative `glm53-serve generate` token for token, with the MTP KV sent and with
it opted out (draft_kv_transfer: false); the shipped tiny layer accepts drafts (spec_verify_ct
below the tokens generated). With the KV sent, prefill's last stage sends the prompt's last
hidden row in the metadata row and decode drafts at its first step: a request's first verify
(read from the streamed events' running spec_verify_ct) commits drafts for some prompts; opted
out, every first verify checks [first token] alone (one token)."""

from __future__ import annotations

import json

import httpx
import pytest

from glm53.models import GlmConfig
from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.cluster import Cluster
from tests.e2e.served import GREEDY_PROMPTS, offline_greedy, wait_pages_free

NEW_TOKENS = 16
# Short code prompts for the first verify only (max_new_tokens 5: the first token and one full verify).
FIRST_STEP_TEXTS = ["def fibonacci(n):\n    if n <", "import httpx\n\nclient = httpx.", "for i in range(10):\n    print(",
                    "class Response:\n    def __init__(self,", "    return self._", "with open(path) as f:\n    data = f."]


def streamed(url: str, body: dict) -> tuple[list[int], int | None]:
    """(the final output ids, tokens the first verify committed, or None when the events merged it
    with a later verify)."""
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=180) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = None
    for e in events:
        v = e["meta_info"]["spec_verify_ct"]
        if v >= 1:
            first = len(e["output_ids"]) - 1 if v == 1 else None  # prefill committed exactly one
            break
    return events[-1]["output_ids"], first


@pytest.fixture(scope="module")
def target_dir(model_cache):
    d = ensure_embedded_model(model_cache)
    assert GlmConfig.from_dir(d).num_nextn_predict_layers == 1, "the embedded checkpoint ships its MTP layer"
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
        firsts = [streamed(c.url, {"text": t, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                   "ignore_eos": True}})[1]
                  for t in FIRST_STEP_TEXTS]
        seen = [f for f in firsts if f is not None]
        assert seen, firsts
        if transfer:  # the seeded first step drafts: some first verify commits drafts
            assert max(seen) > 1, firsts
        else:  # no seed: the first verify checks [first token] alone
            assert set(seen) == {1}, firsts
        info = httpx.get(f"{c.url}/get_server_info", timeout=30).json()
        assert "NEXTN" in str(info), info
        wait_pages_free(c)
    finally:
        c.stop()

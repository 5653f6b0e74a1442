"""Stop strings are decided by decode, at the token that completes the match: with DFlash on and
the trained pair (verify steps accept runs of several tokens), nothing committed after that
token reaches the client. Text, output ids, logprobs and usage agree with non-speculative greedy
decoding cut at the first match, for /v1/completions (plain, n = 2, streamed) and /generate.
(tests/server/test_spec_verify_real.py puts the match inside an accepted run deterministically.)"""

from __future__ import annotations

import json

import httpx
import pytest

from glm53.server.embedded_model import ensure_embedded_model
from glm53.server.tokenizer import Tokenizer
from glm53.support.cluster import Cluster
from tests.e2e.served import offline_greedy, wait_pages_free

# The prompt an issue reported this with (default config, DFlash on): 8 tokens were charged
# and returned for text that ended before "sys".
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
NEW = 30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache):
    c = Cluster(tmp_path_factory.mktemp("stops"), model_cache,
                speculative={"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash"}).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def expected(model_cache):
    """(stop string, the greedy tokens up to the one completing it, the text before it)."""
    target = ensure_embedded_model(model_cache)
    tok = Tokenizer.from_dir(target)
    ref = offline_greedy(target, [tok.encode(PROMPT)], NEW)[0]
    text = tok.decode(ref)
    stop = "sys" if "sys" in text else text[len(text) // 3: len(text) // 3 + 3]
    k = next(k for k in range(1, len(ref) + 1) if stop in tok.decode(ref[:k]))
    assert k < NEW, "the stop string must end the request early"
    return stop, ref[:k], tok.decode(ref[:k]).split(stop)[0]


def test_completions_cut_at_the_stop_string(cluster, expected):
    stop, ids, text = expected
    body = {"model": "glm-5-tiny", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stop": [stop],
            "logprobs": 0, "ignore_eos": True}
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120).json()
    for choice in r["choices"]:
        assert choice["text"] == text and choice["finish_reason"] == "stop" and choice["matched_stop"] == stop
        assert len(choice["logprobs"]["tokens"]) == len(ids) == len(choice["logprobs"]["token_logprobs"])
    assert r["usage"]["completion_tokens"] == len(ids)
    two = httpx.post(f"{cluster.url}/v1/completions", json={**body, "n": 2}, timeout=120).json()
    assert [c["text"] for c in two["choices"]] == [text, text]
    assert two["usage"]["completion_tokens"] == 2 * len(ids)
    # A stop-string finish is decode's, not an abort.
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    aborted = [ln for ln in metrics.splitlines() if ln.startswith("sglang:num_aborted_requests_total")]
    assert aborted and all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in aborted), aborted
    wait_pages_free(cluster)


def test_streamed_completion_cut_at_the_stop_string(cluster, expected):
    stop, ids, text = expected
    body = {"model": "glm-5-tiny", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stop": [stop],
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == len(ids)


def test_generate_output_ids_end_at_the_stop_string(cluster, expected):
    stop, ids, text = expected
    r = httpx.post(f"{cluster.url}/generate", timeout=120, json={
        "text": PROMPT, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "stop": [stop], "ignore_eos": True}}).json()
    assert r["output_ids"] == ids and r["text"] == text
    meta = r["meta_info"]
    assert meta["completion_tokens"] == len(ids) and len(meta["output_token_logprobs"]) == len(ids)
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    wait_pages_free(cluster)

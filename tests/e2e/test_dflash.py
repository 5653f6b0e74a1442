"""DFlash (and DSpark) across the PD split, through real processes: prefill writes the prompt's draft context
KV into the `draft_kv` pool and sends it with the target KV; decode drafts and verifies. Greedy
output with DFlash on equals greedy without it (`glm53-serve generate`), token for token, for
several block sizes, batch 1 and a ragged concurrent batch, with the draft KV sent or not; the
verify count and the accept-length metric are reported; every pool is back to full afterwards.

The draft has random weights, so it is rarely right (τ ≈ 1): these tests show exactness and the
plumbing; acceptance is the trained pair's to show."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil

import httpx
import pytest

from glm53.models import write_random_draft
from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.cluster import Cluster
from tests.e2e import structured_checks
from tests.e2e.served import GREEDY_PROMPTS, offline_greedy, served_greedy, wait_pages_free
from tests.models.draft_oracle import chain_verify_steps, write_successor_heads

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def target_dir(model_cache):
    return ensure_embedded_model(model_cache)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir):
    d = tmp_path_factory.mktemp("draft")
    return write_random_draft(d, target_dir, seed=5, n_layers=2, block_size=16)


@pytest.fixture(scope="module")
def offline(target_dir):
    return offline_greedy(target_dir, GREEDY_PROMPTS, NEW_TOKENS)


def start(tmp_path_factory, model_cache, draft_dir, **spec) -> Cluster:
    spec = {"algorithm": "DFLASH", "draft_model_path": str(draft_dir), **spec}
    return Cluster(tmp_path_factory.mktemp("dflash"), model_cache, speculative=spec).start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache, draft_dir):
    c = start(tmp_path_factory, model_cache, draft_dir)
    yield c
    c.stop()


def test_greedy_equals_non_speculative_batch_1_and_ragged_batch(cluster, offline):
    assert served_greedy(cluster, GREEDY_PROMPTS, NEW_TOKENS) == offline
    with cf.ThreadPoolExecutor(len(GREEDY_PROMPTS)) as ex:  # decode batches them together
        outs = list(ex.map(lambda p: served_greedy(cluster, [p], NEW_TOKENS)[0], GREEDY_PROMPTS))
    assert outs == offline
    wait_pages_free(cluster)


def test_verify_count_and_accept_metric(cluster):
    r = httpx.post(f"{cluster.url}/generate", timeout=120, json={
        "input_ids": GREEDY_PROMPTS[1], "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    # The first token comes from prefill; each verify commits 1..16 of the other 11.
    assert 1 <= meta["spec_verify_ct"] <= 11 and meta["completion_tokens"] == 12
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    count = [ln for ln in text.splitlines() if ln.startswith("sglang:spec_accept_length_count")]
    assert count and float(count[0].rsplit(" ", 1)[1]) >= meta["spec_verify_ct"]


def test_streamed_verify_count_is_cumulative(cluster):
    # SGLang's streamed /generate: meta_info.spec_verify_ct counts the verify steps so far on every
    # event (not 0 until the last), and ends at the non-streamed count.
    body = {"input_ids": GREEDY_PROMPTS[1], "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True}}
    whole = httpx.post(f"{cluster.url}/generate", timeout=120, json=body).json()["meta_info"]["spec_verify_ct"]
    with httpx.stream("POST", f"{cluster.url}/generate", json={**body, "stream": True}, timeout=120) as r:
        metas = [json.loads(ln[6:])["meta_info"] for ln in r.iter_lines() if ln.startswith("data: {")]
    counts = [m["spec_verify_ct"] for m in metas]
    assert counts == sorted(counts) and counts[-1] == whole, counts
    assert any(m["finish_reason"] is None and m["spec_verify_ct"] > 0 for m in metas), counts


def test_structured_output_at_every_block_position(cluster):
    structured_checks.check_chat_json_schema_and_json_object(cluster, structured_checks.SAMPLING[:2], json_object=False)
    structured_checks.check_generate_regex(cluster, structured_checks.SAMPLING[1])
    wait_pages_free(cluster)


def test_sampled_requests_finish_and_free_pages(cluster):
    with cf.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda i: httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "model": "glm-5-tiny", "prompt": f"def f{i}(x):", "max_tokens": 10, "temperature": 0.9, "seed": i,
            "ignore_eos": True}), range(8)))
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10 for r in rs)
    wait_pages_free(cluster)


@pytest.mark.parametrize("spec", [{"num_draft_tokens": 2}, {"num_draft_tokens": 4, "draft_kv_transfer": False}])
def test_greedy_equals_non_speculative_other_settings(tmp_path_factory, model_cache, draft_dir, offline, spec):
    c = start(tmp_path_factory, model_cache, draft_dir, **spec)
    try:
        assert served_greedy(c, GREEDY_PROMPTS, NEW_TOKENS) == offline
        wait_pages_free(c)
    finally:
        c.stop()


def test_batches_above_disable_by_batch_size_decode_the_same(tmp_path_factory, model_cache, draft_dir, offline):
    # speculative.disable_by_batch_size 1: a ragged concurrent batch verifies blocks of one while
    # several requests run and drafts again as they finish; greedy output is unchanged
    c = start(tmp_path_factory, model_cache, draft_dir, disable_by_batch_size=1)
    try:
        with cf.ThreadPoolExecutor(len(GREEDY_PROMPTS)) as ex:
            outs = list(ex.map(lambda p: served_greedy(c, [p], NEW_TOKENS)[0], GREEDY_PROMPTS))
        assert outs == offline
        wait_pages_free(c)
    finally:
        c.stop()


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_draft_kv_moves_between_mismatched_tp(tmp_path_factory, model_cache, draft_dir, offline, algorithm):
    """Prefill tp=1 against decode tp=2: the head-sharded draft KV buffer passes bootstrap and
    moves with the target KV, and the output stays exact. (That each rank's shard holds exactly
    its heads is checked byte for byte in tests/models/test_draft_runner.py.)

    DSPARK: the same draft plus a Markov head that makes every token propose a fixed successor
    (taken from the target's own greedy outputs, so chains are often right and sometimes wrong)
    and a confidence head that cuts blocks after some tokens: every request's spec_verify_ct is
    then known offline, exactly (tests/models/draft_oracle.chain_verify_steps)."""
    spec = {"algorithm": "DFLASH", "draft_model_path": str(draft_dir), "num_draft_tokens": 4}
    if algorithm == "DSPARK":
        d = tmp_path_factory.mktemp("dspark") / "draft"
        shutil.copytree(draft_dir, d)
        succ, confident = {}, {}
        for out in offline:
            for a, b in zip(out, out[1:]):
                succ.setdefault(a, b)
        for t in {t for out in offline for t in out}:
            succ.setdefault(t, offline[0][0])
            confident[t] = t % 3 != 0
        vocab = json.loads((d / "config.json").read_text())["vocab_size"]
        write_successor_heads(d, succ, confident, vocab)
        spec = {"algorithm": "DSPARK", "draft_model_path": str(d), "dspark_block_size": 6,
                "dspark_confidence_threshold": 0.5}
    c = Cluster(tmp_path_factory.mktemp("dflash-tp"), model_cache, speculative=spec, decode_tp=2).start()
    try:
        if algorithm == "DFLASH":
            assert served_greedy(c, GREEDY_PROMPTS, NEW_TOKENS) == offline
        for p, want in zip(GREEDY_PROMPTS, offline if algorithm == "DSPARK" else []):
            r = httpx.post(f"{c.url}/generate", timeout=120, json={"input_ids": p, "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            steps = chain_verify_steps(want[0], want, 6, succ, confident)
            assert r.json()["output_ids"] == want
            assert r.json()["meta_info"]["spec_verify_ct"] == len(steps), steps
        if algorithm == "DSPARK":
            info = httpx.get(f"{c.url}/get_server_info", timeout=10).json()
            assert info["speculative_algorithm"] == "DSPARK" and info["speculative_num_draft_tokens"] == 6
        wait_pages_free(c)
    finally:
        c.stop()


def test_logprobs_penalties_and_n_under_speculation(cluster, target_dir):
    """With DFlash on: logprobs are the target's (verify logits) log_softmax of the committed
    tokens; penalties and logit_bias stay exact (applied per block position); n > 1 choices
    (the draft context KV copied with the prompt's) each equal the n = 1 answer when greedy."""
    from glm53.models import ModelRunner
    from glm53.server.sampling import SamplingParams
    from tests.e2e.reference import TOL, ref_logsoftmax, reference_greedy

    runner = ModelRunner.from_dir(target_dir, num_pages=64, progress=False)
    prompt = GREEDY_PROMPTS[1]

    def gen(body):
        r = httpx.post(f"{cluster.url}/generate", timeout=120, json={"input_ids": prompt, **body})
        assert r.status_code == 200, r.text
        return r.json()

    out = gen({"return_logprob": True, "top_logprobs_num": 2,
               "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})
    ids = out["output_ids"]
    ref = ref_logsoftmax(runner, prompt + ids)
    for j, (lp, tid, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert tid == ids[j] and abs(lp - ref[len(prompt) - 1 + j, tid].item()) < TOL
    kw = {"frequency_penalty": 1.2, "repetition_penalty": 1.5, "logit_bias": {"40": 3.0}}
    got = gen({"sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, **kw}})["output_ids"]
    assert got == reference_greedy(runner, prompt, SamplingParams(temperature=0, **kw), [], 10)
    many = httpx.post(f"{cluster.url}/generate", timeout=120, json={"input_ids": prompt, "sampling_params": {
        "n": 3, "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}).json()
    assert [m["output_ids"] for m in many] == [ids] * 3
    wait_pages_free(cluster)

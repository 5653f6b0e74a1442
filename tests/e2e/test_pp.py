"""Pipeline-parallel prefill end to end through real processes: prefill with pp stages (gloo rank
processes, micro-batches pipelined across stages, each stage sending its own layers' KV to
decode), decode tp=1; greedy output equals the one-process `glm53-serve generate` token for
token, with DFlash off and on, and with DSpark (the draft's context projected partially on every
stage)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from glm53.models import write_random_draft
from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.cluster import Cluster
from tests.e2e.reference import TOL, ref_logsoftmax
from tests.e2e.served import GREEDY_PROMPTS, offline_greedy, served_greedy, wait_pages_free

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


@pytest.fixture(scope="module")
def runner(target_dir):
    from glm53.models import ModelRunner

    return ModelRunner.from_dir(target_dir, num_pages=64, progress=False)


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory, target_dir):
    # The same shape with DSpark's Markov and confidence heads (random: the cut lands anywhere).
    return write_random_draft(tmp_path_factory.mktemp("dspark"), target_dir, seed=9, n_layers=2, block_size=4,
                              markov_rank=8, confidence_head=True)


@pytest.mark.parametrize("pp, tp, algorithm", [(2, 1, None), (3, 1, "DFLASH"), (2, 2, "DSPARK")])
def test_pp_prefill_greedy_equals_offline(tmp_path_factory, model_cache, draft_dir, dspark_dir, offline, runner, pp,
                                          tp, algorithm):
    spec = None
    if algorithm == "DFLASH":
        spec = {"algorithm": "DFLASH", "draft_model_path": str(draft_dir)}
    elif algorithm == "DSPARK":
        spec = {"algorithm": "DSPARK", "draft_model_path": str(dspark_dir), "dspark_confidence_threshold": 0.4}
    c = Cluster(tmp_path_factory.mktemp(f"pp{pp}tp{tp}"), model_cache, prefill_pp=pp, prefill_tp=tp,
                speculative=spec).start()
    try:
        assert served_greedy(c, GREEDY_PROMPTS, NEW_TOKENS) == offline
        # prompt logprobs from the last stage's logits of every chunk
        prompt = GREEDY_PROMPTS[-1]
        r = httpx.post(f"{c.url}/generate", timeout=120, json={
            "input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        ref = ref_logsoftmax(runner, prompt)
        got = r.json()["meta_info"]["input_token_logprobs"]
        assert got[0][0] is None and len(got) == len(prompt)
        assert all(abs(got[q][0] - ref[q - 1, prompt[q]].item()) < TOL for q in range(1, len(prompt)))
        wait_pages_free(c)
    finally:
        c.stop()


def test_stage_killed_mid_prefill(tmp_path_factory, model_cache):
    """A prefill stage dies while a request is in its pipeline: the client gets a clear error,
    decode's and every stage's pages come back, and the prefill instance reports unhealthy."""
    c = Cluster(tmp_path_factory.mktemp("ppkill"), model_cache, prefill_pp=2, transfer_timeout_s=10.0).start()
    try:
        sched = c.instance_pid("prefill")
        stages = [int(p) for p in subprocess.run(["pgrep", "-P", str(sched), "-f", "spawn_main"],
                                                 capture_output=True, text=True).stdout.split()]
        assert stages, "prefill pp=2 runs a second stage process"
        with httpx.Client(timeout=60) as http:
            # The stopped stage holds the pipeline: the request is stuck inside it when it dies.
            for pid in stages:
                os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            result = {}
            t = threading.Thread(target=lambda: result.update(r=http.post(f"{c.url}/generate", json={
                "input_ids": GREEDY_PROMPTS[2], "sampling_params": {"max_new_tokens": 4}})))
            t.start()
            time.sleep(1.0)
            for pid in stages:
                os.kill(pid, signal.SIGKILL)
            t.join(30)
            r = result["r"]
        assert r.status_code >= 500 and "lost a rank" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 15
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (c.kv_tokens_in_use().get("p0") != 0
                                               or c.kv_tokens_in_use().get("d0") != 0):
            time.sleep(0.5)
        assert c.kv_tokens_in_use() == {"p0": 0, "d0": 0}
        while time.monotonic() < deadline and httpx.get(f"{c.url}/health", timeout=10).status_code != 503:
            time.sleep(0.2)
        health = httpx.get(f"{c.url}/health", timeout=10)
        assert health.status_code == 503 and "prefill" in health.json()["error"]["message"]
    finally:
        c.stop()

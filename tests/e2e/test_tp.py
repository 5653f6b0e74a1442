"""Tensor parallelism end to end through real processes: prefill and decode instances with
different TP sizes (gloo rank processes, KV moved over UCX between mismatched shards), checked
token for token against the one-process `glm53-serve generate`; expert parallelism on one side
(tp = ep = 2: each rank holds half the experts, tokens move by all-to-all) with tp = 1 on the other;
and a rank killed mid-request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from glm53.support.cluster import Cluster
from tests.e2e.served import GREEDY_PROMPTS, MODEL, offline_greedy, served_greedy, wait_pages_free

NEW_TOKENS = 16
TRANSFER_TIMEOUT = 10.0


@pytest.fixture(scope="module")
def offline(model_cache):
    # One run of the reference for every topology below (the cluster fixture of another module
    # may not have created the model yet: a throwaway cluster start would; generate does too).
    from glm53.server.embedded_model import ensure_embedded_model

    return offline_greedy(ensure_embedded_model(model_cache), GREEDY_PROMPTS, NEW_TOKENS)


# (prefill tp, ep), (decode tp, ep). EP does not change the KV layout (the latent and indexer
# caches are replicated), so the mismatched-TP transfers stay covered with ep on one side: the
# tp 2 / ep 1 ranks are the (2, 1) -> (2, 1) case's.
@pytest.mark.parametrize("prefill, decode", [((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (2, 1))],
                         ids=["p-tp2ep2-d-tp1", "p-tp1-d-tp2ep2", "p-tp2-d-tp2"])
def test_tp_mismatched_pd_greedy_equals_offline(tmp_path_factory, model_cache, offline, prefill, decode):
    (prefill_tp, prefill_ep), (decode_tp, decode_ep) = prefill, decode
    c = Cluster(tmp_path_factory.mktemp(f"tp{prefill_tp}{decode_tp}"), model_cache, prefill_tp=prefill_tp,
                decode_tp=decode_tp, prefill_ep=prefill_ep, decode_ep=decode_ep).start()
    try:
        assert served_greedy(c, GREEDY_PROMPTS, NEW_TOKENS) == offline
        # n = 2 on the same prefill (decode copies the prompt's pages on every rank) and prompt
        # logprobs from every prefill chunk's logits
        r = httpx.post(f"{c.url}/generate", timeout=120, json={
            "input_ids": GREEDY_PROMPTS[0], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"n": 2, "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        items = r.json()
        assert [x["output_ids"] for x in items] == [offline[0]] * 2
        assert all(len(x["meta_info"]["input_token_logprobs"]) == len(GREEDY_PROMPTS[0]) for x in items)
        wait_pages_free(c)
    finally:
        c.stop()


def rank_pids(cluster: Cluster, role: str) -> list[int]:
    """The follower rank processes the instance's scheduler spawned."""
    sched = cluster.instance_pid(role)
    out = subprocess.run(["pgrep", "-P", str(sched)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_rank_killed_mid_request_fails_it_and_the_instance_reports_unhealthy(tmp_path_factory, model_cache):
    c = Cluster(tmp_path_factory.mktemp("tpkill"), model_cache, transfer_timeout_s=TRANSFER_TIMEOUT,
                decode_tp=2).start()
    try:
        followers = rank_pids(c, "decode")
        assert followers, "decode tp=2 runs a follower rank process"
        events, t_kill = [], None
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", f"{c.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 3:
                        for pid in followers:
                            os.kill(pid, signal.SIGKILL)
                        t_kill = time.monotonic()
                    if line == "data: [DONE]":
                        break
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "lost a rank" in err["message"], err
        assert time.monotonic() - t_kill < TRANSFER_TIMEOUT, "the failure must not wait for a timeout"
        # The router stays up; the decode instance reports itself unhealthy, so /health says so.
        assert httpx.get(f"{c.url}/v1/models", timeout=10).status_code == 200
        deadline = time.monotonic() + 10
        while httpx.get(f"{c.url}/health", timeout=10).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        health = httpx.get(f"{c.url}/health", timeout=10)
        assert health.status_code == 503 and "decode" in health.json()["error"]["message"]
        # New requests fail fast with a clear error, never hang.
        r = httpx.post(f"{c.url}/v1/completions", timeout=TRANSFER_TIMEOUT + 10,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code in (503, 504) and r.json()["error"]["message"]
        # The prefill side released the room's pages.
        deadline = time.monotonic() + TRANSFER_TIMEOUT + 5
        while c.kv_tokens_in_use().get("p0") != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert c.kv_tokens_in_use().get("p0") == 0
    finally:
        c.stop()

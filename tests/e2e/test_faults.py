"""Faults through real processes: a client that goes away, and a decode process killed
mid-stream. Nothing hangs, the client gets an error event and [DONE], pages return."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from glm53.support.cluster import Cluster
from tests.e2e.served import MODEL, wait_pages_free

TRANSFER_TIMEOUT = 8.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache):
    # `up` would restart the killed decode within seconds; this module checks life without one.
    c = Cluster(tmp_path_factory.mktemp("faults"), model_cache, transfer_timeout_s=TRANSFER_TIMEOUT,
                router={"restart_backoff_s": 60.0}).start()
    yield c
    c.stop()


def long_stream_body(max_tokens: int = 1500) -> dict:
    return {"model": MODEL, "prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


def test_client_disconnect_aborts_on_both_instances_and_frees_pages(cluster):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{cluster.url}/v1/completions", json=long_stream_body()) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: {")
                if n >= 3:
                    break  # leave mid-stream: the connection closes here
    wait_pages_free(cluster)
    # The instances keep serving.
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_decode_killed_mid_stream_gives_error_event_and_done(cluster):
    events, t_kill = [], None
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{cluster.url}/v1/completions", json=long_stream_body()) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(cluster.instance_pid("decode"), signal.SIGKILL)
                    t_kill = time.monotonic()
                if line == "data: [DONE]":
                    break
    elapsed = time.monotonic() - t_kill
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert "error" in err and err["error"]["message"]
    assert elapsed < TRANSFER_TIMEOUT + 5, elapsed
    # The router stays up and answers.
    assert httpx.get(f"{cluster.url}/v1/models", timeout=10).status_code == 200
    health = httpx.get(f"{cluster.url}/health", timeout=10)
    assert health.status_code in (200, 503)
    # The prefill instance released the room's pages once its sender failed.
    deadline = time.monotonic() + TRANSFER_TIMEOUT + 5
    while cluster.kv_tokens_in_use().get("p0") != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.kv_tokens_in_use().get("p0") == 0
    # With no decode left, a new request fails fast with a clear status, never hangs.
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=TRANSFER_TIMEOUT + 10,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert r.status_code in (503, 504) and r.json()["error"]["message"]

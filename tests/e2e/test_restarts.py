"""Faults at the edges, through a real `glm53-serve up`: an instance killed and restarted faster
than the router's health timeout, a request sent at the moment of a kill, and a stream through
SIGTERM of `up`.

A restarted instance is a new incarnation (its pongs say so), so the router fails the rooms the
old process held at once, with a clear error, even though it never saw the instance go silent
(health_timeout_s is 30 s here, longer than a restart); a prefill failure before the first token
is retried, on the restarted instance too. On SIGTERM the router fails what it holds first, so a
stream ends with an error event and [DONE] and `up` does not wait out uvicorn's graceful timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from glm53.support.cluster import Cluster
from tests.e2e.served import MODEL, wait_pages_free

HEALTH_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_cache):
    c = Cluster(tmp_path_factory.mktemp("restarts"), model_cache, transfer_timeout_s=20.0,
                router={"health_check_interval_s": 0.5, "health_timeout_s": HEALTH_TIMEOUT,
                        "restart_backoff_s": 0.2, "max_restarts": 100})
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    c.start()
    threading.Thread(target=lambda: [None for _ in c.proc.stdout], daemon=True).start()  # access log
    yield c
    c.stop()


def _stream_body(max_tokens: int = 1500) -> dict:
    return {"model": MODEL, "prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


def _wait_healthy(c: Cluster, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.post(c.url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "ok?", "max_tokens": 2, "ignore_eos": True})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("the cluster did not serve again after the restart")


def _stream_until(c: Cluster, on_event_3) -> tuple[list[str], float]:
    """Stream a long completion; call `on_event_3()` at its third event; return the events and
    the seconds from then to the end of the stream."""
    events, t_fault = [], None
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", c.url + "/v1/completions", json=_stream_body()) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    on_event_3()
                    t_fault = time.monotonic()
                if line == "data: [DONE]":
                    break
    return events, time.monotonic() - t_fault


def test_decode_killed_and_restarted_fails_its_stream_at_once(cluster):
    events, elapsed = _stream_until(cluster, lambda: os.kill(cluster.instance_pid("decode"), signal.SIGKILL))
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert "restarted" in err["message"] or "stopped responding" in err["message"], err
    # It came back long before health_timeout_s: only its new incarnation can have told the router.
    assert "restarted" in err["message"] and elapsed < 20.0, (elapsed, err)
    _wait_healthy(cluster)
    wait_pages_free(cluster)


def test_request_at_the_moment_prefill_is_killed_is_answered_fast(cluster):
    """The chaos case: requests sent within milliseconds of a prefill SIGKILL (which `up`
    restarts within seconds, before the router's health timeout) get an answer (retried on the
    restarted prefill) or a clear 503 quickly, not a 504 after the bootstrap timeout."""
    results: list[tuple[int, str, float]] = []

    def send(delay: float) -> None:
        time.sleep(delay)
        t0 = time.monotonic()
        try:
            r = httpx.post(cluster.url + "/v1/completions", timeout=90,
                           json={"model": MODEL, "prompt": "at the kill", "max_tokens": 4, "ignore_eos": True})
            results.append((r.status_code, r.text[:200], time.monotonic() - t0))
        except httpx.HTTPError as e:
            results.append((0, repr(e), time.monotonic() - t0))

    threads = [threading.Thread(target=send, args=(d,)) for d in (0.0, 0.002, 0.02, 0.2)]
    pid = cluster.instance_pid("prefill")
    for t in threads:
        t.start()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4, results
    for status, text, seconds in results:
        assert status in (200, 503), results
        if status == 503:
            assert json.loads(text)["error"]["message"], results
        assert seconds < 20.0, results  # it hung 35.6 s, then 504, before incarnations
    _wait_healthy(cluster)
    wait_pages_free(cluster)


def test_stream_through_sigterm_ends_with_error_event_and_done(cluster):
    """Last in this module: it stops the cluster. The router ends the stream with an error event
    and [DONE] and exits at once, not after uvicorn's 5 s graceful timeout (the instances take
    their own bounded time to close their transfer engines)."""
    router = int(subprocess.run(["pgrep", "-P", str(cluster.proc.pid), "-f", "glm53.server.cli router"],
                                capture_output=True, text=True).stdout.split()[0])
    events, elapsed = _stream_until(cluster, lambda: os.kill(cluster.proc.pid, signal.SIGTERM))
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert "shutting down" in err["message"] and err["code"] == 503, err
    assert elapsed < 2.0, elapsed
    deadline = time.monotonic() + 3.0 - elapsed
    while _alive(router) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(router), "the router did not exit within 3 s of SIGTERM"
    cluster.proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False

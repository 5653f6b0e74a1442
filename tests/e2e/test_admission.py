"""A burst several times the cluster's capacity queues instead of failing (router/admission.py):
every request either completes or gets a 503 with Retry-After and an OpenAI-style error body
within router.max_queue_wait_s, none fails as a transfer timeout (the transfer timeouts here are
shorter than the queue waits), and every KV page pool is full again afterwards.

Capacity: decode runs at most 4 rooms (max_running_requests) and its KV pool holds 2 of them
(num_pages), so the router queues beyond 4 and decode queues 2 more for pages; at most 12 wait
at the router (max_queued_requests)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import yaml

from glm53.support.cluster import Cluster
from tests.e2e.served import MODEL, wait_pages_free

QUEUE_WAIT = 5.0
N, STREAMED, PROMPT, OUT = 36, 9, 150, 32


def _cluster(tmp_path_factory, model_cache) -> Cluster:
    c = Cluster(tmp_path_factory.mktemp("admission"), model_cache, transfer_timeout_s=3.0,
                router={"max_queue_wait_s": QUEUE_WAIT, "max_queued_requests": 12})
    c.cfg["decode"][0].update({"max_running_requests": 4, "num_pages": 24})  # 12 pages a request
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    c.start()
    threading.Thread(target=lambda: [None for _ in c.proc.stdout], daemon=True).start()  # access log
    return c


def _check_503(status: int, headers, body: dict) -> str:
    assert status == 503, (status, body)
    assert int(headers["retry-after"]) >= 1, headers
    err = body["error"]
    assert err["code"] == 503 and err["message"] and "type" in err and "param" in err, body
    return err["message"]


async def _one(http: httpx.AsyncClient, url: str, k: int) -> tuple[str, str, float]:
    body = {"model": MODEL, "prompt": [(i * 37 + k * 101) % 3900 + 10 for i in range(PROMPT)], "max_tokens": OUT,
            "temperature": 0, "ignore_eos": True, "stream": k < STREAMED}
    t0 = time.monotonic()
    if not body["stream"]:
        r = await http.post(url + "/v1/completions", json=body)
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == OUT, r.text
            return "ok", "", time.monotonic() - t0
        return "503", _check_503(r.status_code, r.headers, r.json()), time.monotonic() - t0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return "503", _check_503(r.status_code, r.headers, json.loads(r.text)), time.monotonic() - t0
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:  # queued past the bound on an instance after the stream began
        assert last["error"]["code"] == 503, last
        return "503", last["error"]["message"], time.monotonic() - t0
    n = sum(len(json.loads(e)["choices"]) for e in events[:-1] if json.loads(e).get("choices"))
    assert n >= 1, events
    return "ok", "", time.monotonic() - t0


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def test_burst_queues_and_refuses_only_past_the_bounds(tmp_path_factory, model_cache):
    c = _cluster(tmp_path_factory, model_cache)
    try:
        httpx.post(c.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "warm up", "max_tokens": 2})

        async def burst():
            limits = httpx.Limits(max_connections=N + 4)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http:
                return await asyncio.gather(*(_one(http, c.url, k) for k in range(N)))

        results = asyncio.run(burst())
        summary = [(kind, round(t, 1), msg[:70]) for kind, msg, t in results]
        ok = [t for kind, _, t in results if kind == "ok"]
        refused = [(msg, t) for kind, msg, t in results if kind == "503"]
        assert len(ok) + len(refused) == N, summary
        assert ok and refused, summary
        # More than the router's queue holds arrived at once: the excess is refused at once.
        assert any("max_queued_requests" in m and t < 2.0 for m, t in refused), summary
        # Every refusal is one of the two bounds (whether a queued request outwaits
        # max_queue_wait_s depends on this machine's speed; tests/server/test_admission.py
        # refuses one at that bound deterministically), and none comes after the bound.
        assert all("max_queued_requests" in m or "max_queue_wait_s" in m for m, _ in refused), refused
        assert all(t < QUEUE_WAIT + 3.0 for _, t in refused), summary
        for m, _ in refused:  # queueing, never a transfer fault
            assert "transfer" not in m and "timed out" not in m, m
        wait_pages_free(c)
        assert httpx.get(c.url + "/server_info", timeout=10).json()["router"]["queued_requests"] == 0
        text = httpx.get(c.url + "/metrics", timeout=10).text
        assert _metric(text, "sglang:queue_time_seconds_count") >= len(ok), text
        assert _metric(text, "sglang:num_transfer_failed_reqs_total") == 0
        assert re.search(r'^sglang:num_queue_reqs\{[^}]*engine_type="router"[^}]*\} 0\.0$', text, re.M), text
        assert re.search(r'^glm53:queue_rejected_requests_total\{[^}]*reason="full"[^}]*\} [1-9]', text, re.M)
        # And the cluster serves as before.
        r = httpx.post(c.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "after", "max_tokens": 4,
                                                                   "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        c.stop()

"""The fault suite, bounded for `make test` (benchmarks/soak.py runs the same driver longer):
random requests and client aborts while prefill and decode are killed (and restarted by `up`)
or frozen; afterwards the cluster heals, every KV pool is full again, every client got a
complete answer or a clear error in time, and the router's memory is back near its baseline."""

from __future__ import annotations

import os
import signal
import time

import httpx

from glm53.support import chaos


def test_random_faults_and_aborts(tmp_path_factory, model_cache):
    plan = chaos.Plan(duration_s=32.0, clients=5, fault_gap_s=(4.5, 7.0), seed=17)
    c = chaos.start_cluster(tmp_path_factory.mktemp("chaos"), model_cache)
    try:
        report = chaos.run(c, plan)
        healed = chaos.settle(c, report)
        after_restart = _first_request_after_prefill_restart(c) if healed else None
    finally:
        c.stop()
    summary = report.summary()
    print("\n" + summary)
    assert healed, summary
    assert report.count("broken") == 0 and report.count("hung") == 0, summary
    assert report.worst() < plan.deadline_s, summary
    assert len(report.faults) >= 3 and report.count("ok") >= 10, summary
    # Failures are the server's to report, and only as unavailable / timed out.
    assert all(cause[:3] in ("503", "504") for cause in report.errors_by_cause()), summary
    assert report.pools_after and all(v == 0 for v in report.pools_after.values()), summary
    assert report.rss_after_mb < report.rss_base_mb + 64, summary
    # Decode held the killed prefill's rank endpoints: it must notice they are gone (ping, then
    # query the bootstrap server again) instead of waiting out peer liveness (10 s).
    status, seconds = after_restart
    assert status == 200 and seconds < 5.0, (status, seconds)


def _first_request_after_prefill_restart(c) -> tuple[int, float]:
    """Kill prefill, wait for the router to see it gone and then back; time one request."""
    os.kill(c.instance_pid("prefill"), signal.SIGKILL)
    deadline = time.monotonic() + 60
    seen_down = False
    while time.monotonic() < deadline:
        try:
            healthy = all(i["healthy"] for i in httpx.get(c.url + "/server_info", timeout=5).json()["prefill"])
        except (httpx.HTTPError, ValueError):
            healthy = False
        seen_down = seen_down or not healthy
        if seen_down and healthy:
            break
        time.sleep(0.2)
    t0 = time.monotonic()
    r = httpx.post(c.url + "/v1/completions", timeout=60,
                   json={"model": chaos.MODEL, "prompt": "after a restart", "max_tokens": 4, "ignore_eos": True})
    return r.status_code, time.monotonic() - t0

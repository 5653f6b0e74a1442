"""The fault suite, bounded for `make test` (benchmarks/soak.py runs the same driver longer):
random requests and client aborts while prefill and decode are killed (and restarted by `up`)
or frozen; afterwards the cluster heals, every KV pool is full again, every client got a
complete answer or a clear error in time, and the router's memory is back near its baseline."""

from __future__ import annotations

from tests.e2e import chaos


def test_random_faults_and_aborts(tmp_path_factory, model_cache):
    plan = chaos.Plan(duration_s=32.0, clients=5, fault_gap_s=(4.5, 7.0), seed=17)
    c = chaos.start_cluster(tmp_path_factory.mktemp("chaos"), model_cache)
    try:
        report = chaos.run(c, plan)
        healed = chaos.settle(c, report)
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

"""Soak under faults: the driver of tests/e2e/test_chaos.py (glm53.support.chaos), run for minutes
instead of seconds.

Starts a 1P1D `glm53-serve up` deployment of the embedded model, sends a random mix of short and
long, streamed and whole, chat and completion requests from several clients (some abandoned
part-way) while prefill and decode are killed (SIGKILL; `up` restarts them) or frozen
(SIGSTOP/SIGCONT), then waits for the cluster to heal and prints what happened: requests by
outcome, faults injected, errors by cause, latencies, the settle time, the router's RSS and the
KV tokens still in use. Exit code 1 if a request broke or hung, or the cluster did not heal.

    PYTHONPATH=. python benchmarks/soak.py            # 5 minutes, 6 clients
    PYTHONPATH=. python benchmarks/soak.py --duration 900 --clients 8 --seed 3 --json soak.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from glm53.support import chaos


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load and faults")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--fault-gap", type=float, nargs=2, default=(6.0, 12.0), metavar=("MIN", "MAX"),
                    help="seconds between faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    cache = Path(os.environ.get("GLM53_CACHE", Path.home() / ".cache" / "glm53-serve"))
    plan = chaos.Plan(duration_s=args.duration, clients=args.clients, fault_gap_s=tuple(args.fault_gap),
                      seed=args.seed)
    c = chaos.start_cluster(Path(tempfile.mkdtemp(prefix="glm53-soak-")), cache)
    try:
        report = chaos.run(c, plan)
        healed = chaos.settle(c, report)
    finally:
        c.stop()
    ok = [o.seconds for o in report.outcomes if o.kind == "ok"]
    print(report.summary())
    print(f"ok latency p50 {pct(ok, 0.5):.2f} s, p99 {pct(ok, 0.99):.2f} s, mean {statistics.fmean(ok):.2f} s"
          if ok else "no complete answers")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "plan": dataclasses.asdict(plan), "requests": len(report.outcomes),
            "outcomes": {k: report.count(k) for k in ("ok", "error", "aborted", "broken", "hung")},
            "faults": report.faults, "errors_by_cause": report.errors_by_cause(),
            "worst_latency_s": report.worst(), "worst_ok_latency_s": report.worst("ok"),
            "ok_p50_s": pct(ok, 0.5), "ok_p99_s": pct(ok, 0.99), "settle_s": report.settle_s,
            "router_rss_mb": [report.rss_base_mb, report.rss_after_mb], "kv_tokens_after": report.pools_after,
            "healed": healed}, indent=1))
    bad = report.count("broken") + report.count("hung")
    return 0 if healed and not bad else 1


if __name__ == "__main__":
    sys.exit(main())

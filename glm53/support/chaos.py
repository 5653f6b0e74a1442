"""A fault-and-soak driver for a real `glm53-serve up` deployment: clients send a random mix of
short and long, streamed and whole, chat and completion requests, some of which they abandon
part-way, while a fault task kills (SIGKILL, restarted by `up`) or freezes (SIGSTOP, then SIGCONT)
the prefill and decode instances. Every request is classified:

    ok       a complete answer: the requested number of tokens and a finish reason (streamed: the
             finish chunk, the usage chunk and [DONE])
    error    a clear error: a JSON error body in vLLM's shape, or in a stream an error event then
             [DONE]; counted by status and cause
    aborted  the client went away on purpose
    broken   anything else (a dropped connection, a stream without [DONE], malformed JSON)
    hung     no answer within the request deadline

After the run `settle` waits for the cluster to heal (every instance healthy, every KV pool full,
nothing running at the router) and measures the router's RSS. Used by tests/e2e/test_chaos.py
(bounded, in `make test`) and benchmarks/soak.py (longer).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx
import yaml

from glm53.support.cluster import Cluster

MODEL = "glm-5-tiny"


@dataclass
class Plan:
    duration_s: float = 40.0
    clients: int = 6
    fault_gap_s: tuple[float, float] = (5.0, 9.0)  # between one fault's end and the next
    stop_s: tuple[float, float] = (1.0, 5.0)  # how long a SIGSTOP lasts
    abort_p: float = 0.15
    long_p: float = 0.25
    deadline_s: float = 60.0  # a request not answered within this has hung
    seed: int = 0


@dataclass
class Outcome:
    kind: str  # ok | error | aborted | broken | hung
    detail: str
    seconds: float
    stream: bool


@dataclass
class Report:
    plan: Plan
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)  # (seconds into the run, what)
    rss_base_mb: float = 0.0
    rss_after_mb: float = 0.0
    settle_s: float = 0.0
    pools_after: dict[str, float] = field(default_factory=dict)

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    def errors_by_cause(self) -> dict[str, int]:
        return dict(collections.Counter(o.detail for o in self.outcomes if o.kind == "error").most_common())

    def worst(self, kind: str | None = None) -> float:
        return max((o.seconds for o in self.outcomes if kind is None or o.kind == kind), default=0.0)

    def summary(self) -> str:
        faults = collections.Counter(f for _, f in self.faults)
        kinds = {k: self.count(k) for k in ("ok", "error", "aborted", "broken", "hung")}
        return (f"requests {len(self.outcomes)} {kinds}; faults {len(self.faults)} {dict(faults)}; "
                f"errors by cause {self.errors_by_cause()}; worst latency {self.worst():.1f} s "
                f"(ok {self.worst('ok'):.1f} s); settled in {self.settle_s:.1f} s; router RSS "
                f"{self.rss_base_mb:.0f} -> {self.rss_after_mb:.0f} MB; KV tokens in use after {self.pools_after}")


def start_cluster(workdir, cache, *, health_timeout_s: float = 3.0, transfer_timeout_s: float = 10.0,
                  bootstrap_timeout_s: float | None = None, prefill: dict | None = None) -> Cluster:
    """A 1P1D deployment of the embedded model that notices faults quickly and restarts what
    dies; `prefill` overrides engine keys of p0."""
    c = Cluster(workdir, cache, transfer_timeout_s=transfer_timeout_s)
    c.cfg["router"].update({"health_check_interval_s": 0.5, "health_timeout_s": health_timeout_s,
                            "restart_backoff_s": 0.5, "max_restarts": 1000})
    if bootstrap_timeout_s is not None:
        c.cfg["transfer"]["bootstrap_timeout_s"] = bootstrap_timeout_s
    c.cfg["prefill"][0].update(prefill or {})
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    c.start()
    # `up`'s children share its stdout (the router's access log goes there): once the test
    # stops reading the pipe after the ready line, a full pipe would freeze whoever writes next.
    threading.Thread(target=lambda: [None for _ in c.proc.stdout], daemon=True).start()
    return c


def router_rss_mb(c: Cluster) -> float:
    pid = subprocess.run(["pgrep", "-P", str(c.proc.pid), "-f", "glm53.server.cli router"],
                         capture_output=True, text=True).stdout.split()[0]
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


# -- requests -------------------------------------------------------------------------------

_CAUSES = [("stopped responding", "instance stopped responding"), ("no healthy", "no healthy instance"),
           ("timed out", "router timeout"), ("transfer", "KV transfer failed"),
           ("at capacity", "at capacity"), ("failed the request", "instance failed the request")]


def _cause(status: int, message: str) -> str:
    low = message.lower()
    return f"{status} " + next((name for key, name in _CAUSES if key in low), re.sub(r"\d+", "N", message)[:60])


def _request(rng: random.Random, plan: Plan) -> tuple[str, dict, int]:
    n_out = rng.randint(1, 48)
    stream = rng.random() < 0.5
    common = {"model": MODEL, "max_tokens": n_out, "temperature": rng.choice([0, 0.8]), "ignore_eos": True,
              "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        words = " ".join(rng.choice(["alpha", "def", "return", "x", "import", "class", "sparse"])
                         for _ in range(rng.randint(2, 30)))
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}, n_out
    n_in = rng.randint(300, 800) if rng.random() < plan.long_p else rng.randint(3, 60)
    return "/v1/completions", {**common, "prompt": [rng.randrange(10, 4000) for _ in range(n_in)]}, n_out


def _check_whole(r: httpx.Response, n_out: int) -> tuple[str, str]:
    try:
        body = r.json()
    except ValueError:
        return "broken", f"{r.status_code}: not JSON"
    if r.status_code != 200:
        e = body.get("error") if isinstance(body, dict) else None
        if isinstance(e, dict) and e.get("code") == r.status_code and e.get("message"):
            return "error", _cause(r.status_code, e["message"])
        return "broken", f"{r.status_code}: not an error body"
    usage, choice = body.get("usage") or {}, (body.get("choices") or [{}])[0]
    if choice.get("finish_reason") == "length" and usage.get("completion_tokens") == n_out:
        return "ok", "complete"
    return "broken", f"incomplete answer: {choice.get('finish_reason')} {usage}"


async def _read_stream(r: httpx.Response, n_out: int) -> tuple[str, str]:
    if r.status_code != 200:
        await r.aread()
        return _check_whole(r, n_out)
    events = []
    async for line in r.aiter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
    if not events or events[-1] != "[DONE]":
        return "broken", "stream ended without [DONE]"
    try:
        objs = [json.loads(e) for e in events[:-1]]
    except ValueError:
        return "broken", "malformed event"
    if objs and "error" in objs[-1]:
        e = objs[-1]["error"]
        return "error", _cause(int(e.get("code") or 0), str(e.get("message")))
    finishes = [o["choices"][0].get("finish_reason") for o in objs if o.get("choices")]
    usage = objs[-1].get("usage") if objs else None
    if "length" in finishes and usage and usage.get("completion_tokens") == n_out:
        return "ok", "complete"
    return "broken", f"incomplete stream: {finishes[-3:]} {usage}"


async def _one(http: httpx.AsyncClient, url: str, rng: random.Random, plan: Plan) -> Outcome:
    path, body, n_out = _request(rng, plan)
    abort_after = rng.uniform(0.05, 2.0) if rng.random() < plan.abort_p else None
    t0 = time.monotonic()

    async def run() -> tuple[str, str]:
        if body["stream"]:
            async with http.stream("POST", url + path, json=body) as r:
                return await _read_stream(r, n_out)
        return _check_whole(await http.post(url + path, json=body), n_out)

    try:
        limit = min(abort_after, plan.deadline_s) if abort_after is not None else plan.deadline_s
        kind, detail = await asyncio.wait_for(run(), limit)
    except asyncio.TimeoutError:
        kind, detail = ("aborted", "client went away") if abort_after is not None else ("hung", "no answer")
    except httpx.HTTPError as e:
        kind, detail = "broken", f"{type(e).__name__}: {e}"
    return Outcome(kind, detail, time.monotonic() - t0, body["stream"])


# -- faults ---------------------------------------------------------------------------------

FAULTS = [("kill", "prefill"), ("kill", "decode"), ("stop", "prefill"), ("stop", "decode")]


async def _faults(c: Cluster, rng: random.Random, plan: Plan, t_end: float, t0: float,
                  log: list[tuple[float, str]]) -> None:
    order: list[tuple[str, str]] = []
    while True:
        await asyncio.sleep(rng.uniform(*plan.fault_gap_s))
        if time.monotonic() > t_end - 2:
            return
        if not order:  # every kind once, in a random order, then again: a short run sees them all
            order = rng.sample(FAULTS, len(FAULTS))
        what, role = order.pop()
        try:
            pid = c.instance_pid(role)
        except AssertionError:
            continue  # between its exit and its restart
        if what == "kill":
            os.kill(pid, signal.SIGKILL)
            log.append((time.monotonic() - t0, f"kill -9 {role}"))
            continue
        stopped = rng.uniform(*plan.stop_s)
        os.kill(pid, signal.SIGSTOP)
        log.append((time.monotonic() - t0, f"SIGSTOP {role} {stopped:.0f}s"))
        try:
            await asyncio.sleep(stopped)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


async def _run(c: Cluster, plan: Plan, report: Report) -> None:
    rng = random.Random(plan.seed)
    t0 = time.monotonic()
    t_end = t0 + plan.duration_s
    limits = httpx.Limits(max_connections=plan.clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(plan.deadline_s + 30), limits=limits) as http:

        async def client(k: int) -> None:
            crng = random.Random(plan.seed * 1000 + k)
            while time.monotonic() < t_end:
                out = await _one(http, c.url, crng, plan)
                report.outcomes.append(out)
                if out.kind == "error":  # as a client would, wait a moment before the next try
                    await asyncio.sleep(crng.uniform(0.3, 0.8))

        faults = asyncio.ensure_future(_faults(c, rng, plan, t_end, t0, report.faults))
        try:
            await asyncio.gather(*(client(k) for k in range(plan.clients)))
        finally:
            faults.cancel()
            try:
                await faults  # its finally sends SIGCONT to a frozen instance
            except asyncio.CancelledError:
                pass


def run(c: Cluster, plan: Plan) -> Report:
    report = Report(plan)
    httpx.post(c.url + "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 4}, timeout=60)
    report.rss_base_mb = router_rss_mb(c)
    asyncio.run(_run(c, plan, report))
    return report


def settle(c: Cluster, report: Report, timeout: float = 60.0) -> bool:
    """Wait until every instance is healthy, every KV pool is full and nothing runs at the router;
    then one more request must complete. Records the time it took and the router's RSS."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    healed = False
    while time.monotonic() < deadline:
        try:
            info = httpx.get(c.url + "/server_info", timeout=5).json()
            used = c.kv_tokens_in_use()
        except (httpx.HTTPError, ValueError):
            time.sleep(0.5)
            continue
        up = all(i["healthy"] for i in info["prefill"] + info["decode"])
        if up and info["router"]["running_requests"] == 0 and used and all(v == 0 for v in used.values()):
            report.pools_after = used
            healed = True
            break
        time.sleep(0.5)
    served = False
    while healed and not served and time.monotonic() < deadline:
        # Retried: a request can still meet what the last fault left (an instance healthy again
        # by its pings while its transfer peers still catch up); each try gets a clear answer.
        r = httpx.post(c.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "after the storm", "max_tokens": 4, "ignore_eos": True})
        served = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    report.settle_s = time.monotonic() - t0
    time.sleep(1.0)  # the router trims its heap after large bodies; let any trim land
    report.rss_after_mb = router_rss_mb(c)
    return healed and served

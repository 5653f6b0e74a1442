"""Burst benchmark: N concurrent /v1/completions of ~1K-token prompts fired at once, against a
server this script starts (`glm53-serve up` on a copy of a config with free ports) or one given by
`--url`. Prints how many completed, how many got a 503 (and whether with Retry-After), the other
errors by status and message, and latency percentiles of each; then the router's queue metrics
and the KV tokens still in use once the burst is over.

    python benchmarks/burst.py                                  # 500 requests, configs/local.yaml
    python benchmarks/burst.py -n 100 --prompt-tokens 512 --json burst.json
    python benchmarks/burst.py --url http://127.0.0.1:30000 --model glm-5-tiny

Every prompt is distinct random token ids (no prefix-cache hits); completions are greedy with
`ignore_eos`, so each asks for exactly `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from glm53.support.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    status: int  # 0: no HTTP answer (connection error, client timeout)
    seconds: float
    detail: str  # "ok", or the error's normalised message
    retry_after: str | None = None
    tokens: int = 0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_server(config: str, workdir: Path, log_path: Path) -> tuple[subprocess.Popen, str, str]:
    """`glm53-serve up` on `config` with every pinned port moved to a free one (so the run can
    sit beside another server); returns the process, its URL and its first served model name."""
    cfg = yaml.safe_load(Path(config).read_text())
    router = cfg.setdefault("router", {})
    pinned = [(router, "port"), (router, "result_port")]
    for role in ("prefill", "decode"):
        for entry in cfg.get(role) or []:
            pinned += [(entry, k) for k in ("port", "bootstrap_port") if k in entry or k == "port"]
    pinned = [(d, k) for d, k in pinned if k in d]
    for (d, k), port in zip(pinned, free_ports(len(pinned))):
        d[k] = port
    path = workdir / "burst.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), "PYTHONUNBUFFERED": "1"}
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "glm53.server.cli", "up", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "ready" in line:
            # The router's access log shares the pipe: keep draining it so nobody blocks on it.
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            names = (cfg.get("model") or {}).get("served_model_name") or ["glm-5-tiny"]
            return proc, f"http://127.0.0.1:{router['port']}", names[0]
        if not line and proc.poll() is not None:
            break
    stop_server(proc)
    raise SystemExit(f"server did not become ready; see {log_path}")


def stop_server(proc: subprocess.Popen) -> float:
    """SIGTERM to `up`'s group; the seconds it took to exit."""
    t0 = time.monotonic()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return time.monotonic() - t0


def _normalise(message: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", message)[:90]


async def one(http: httpx.AsyncClient, url: str, body: dict) -> Result:
    t0 = time.monotonic()
    try:
        r = await http.post(url + "/v1/completions", json=body)
    except httpx.HTTPError as e:
        return Result(0, time.monotonic() - t0, f"{type(e).__name__}: {_normalise(str(e))}")
    dt = time.monotonic() - t0
    try:
        data = r.json()
    except ValueError:
        return Result(r.status_code, dt, "not JSON")
    if r.status_code == 200:
        return Result(200, dt, "ok", tokens=(data.get("usage") or {}).get("completion_tokens", 0))
    err = data.get("error") if isinstance(data, dict) else None
    msg = err.get("message", "") if isinstance(err, dict) else str(data)[:90]
    return Result(r.status_code, dt, _normalise(msg), r.headers.get("retry-after"))


async def burst(url: str, model: str, n: int, prompt_tokens: int, max_tokens: int, seed: int,
                client_timeout: float) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    bodies = [{"model": model, "prompt": [rng.randrange(10, 4000) for _ in range(prompt_tokens)],
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for _ in range(n)]
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=client_timeout, limits=limits) as http:
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(http, url, b) for b in bodies))
        return list(results), time.monotonic() - t0


def metric_values(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Unlabelled sums of the named Prometheus series (every label set added up)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in names:
            out[m.group(1) + (m.group(2) or "")] += float(m.group(3))
    return dict(out)


def wait_settled(url: str, timeout: float = 120.0) -> dict[str, float]:
    """KV tokens in use per instance once nothing runs at the router (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    used: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            info = httpx.get(url + "/server_info", timeout=10).json()
            text = httpx.get(url + "/metrics", timeout=10).text
        except (httpx.HTTPError, ValueError):
            time.sleep(1)
            continue
        used = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^sglang:num_used_tokens\{[^}]*instance="([^"]+)"[^}]*\} (\S+)$', text, re.M)}
        if info["router"]["running_requests"] == 0 and used and all(v == 0 for v in used.values()):
            break
        time.sleep(1)
    return used


def report(results: list[Result], wall: float) -> dict:
    ok = [r.seconds for r in results if r.status == 200]
    s503 = [r for r in results if r.status == 503]
    other = collections.Counter(f"{r.status} {r.detail}" for r in results if r.status not in (200, 503))
    by503 = collections.Counter(r.detail for r in s503)
    other_s = [r.seconds for r in results if r.status not in (200, 503)]
    return {
        "requests": len(results), "wall_s": round(wall, 1),
        "completed": len(ok), "503": len(s503), "503_with_retry_after": sum(r.retry_after is not None for r in s503),
        "other_errors": sum(other.values()),
        "503_by_message": dict(by503.most_common()), "other_by_message": dict(other.most_common()),
        "completed_latency_s": {"p50": pct(ok, 0.5), "p90": pct(ok, 0.9), "p99": pct(ok, 0.99), "max": max(ok, default=0)},
        "503_latency_s": {"p50": pct([r.seconds for r in s503], 0.5), "max": max((r.seconds for r in s503), default=0)},
        "other_latency_s": {"p50": pct(other_s, 0.5), "max": max(other_s, default=0)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"), help="config to start (no --url)")
    ap.add_argument("--url", help="use this running server instead of starting one")
    ap.add_argument("--model", default=None, help="model name to send (default: the config's first served name)")
    ap.add_argument("-n", "--requests", type=int, default=500)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-timeout", type=float, default=1800.0, help="seconds a client waits for an answer")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()

    proc = None
    workdir = Path(tempfile.mkdtemp(prefix="glm53-burst-"))
    if args.url:
        url, model = args.url.rstrip("/"), args.model or "glm-5-tiny"
    else:
        proc, url, model = start_server(args.config, workdir, workdir / "server.log")
        model = args.model or model
        print(f"server up at {url} (log {workdir / 'server.log'})", flush=True)
    try:
        # Warm up (the first request also connects decode to prefill).
        httpx.post(url + "/v1/completions", timeout=120, json={"model": model, "prompt": "hi", "max_tokens": 2})
        results, wall = asyncio.run(burst(url, model, args.requests, args.prompt_tokens, args.max_tokens,
                                          args.seed, args.client_timeout))
        out = report(results, wall)
        out["kv_tokens_in_use_after"] = wait_settled(url)
        out["metrics_after"] = metric_values(url, ("sglang:queue_time_seconds_count", "sglang:queue_time_seconds_sum",
                                                   "sglang:num_transfer_failed_reqs_total",
                                                   "glm53:queue_rejected_requests_total"))
    finally:
        if proc is not None:
            out_stop = stop_server(proc)
            print(f"server stopped in {out_stop:.1f} s", flush=True)
    out.update({"command": " ".join(sys.argv), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens})
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the PD benchmarks share (benchmarks/dflash_pd.py, draft_compare.py, served_gap.py,
draft_kv_cost.py): both instances on one GPU, greedy requests on HTTP clients made before the clock
starts, one deployment measured one prompt at a time and many at once, and the router's own split
of TTFT.

HTTP clients are made up front because httpx's module functions build a Client per call, ~20-30 ms
for its TLS context; sixteen request threads serialized on that inside a measured window (on the
H200 it showed as a 464 ms client TTFT against the router's own 91 ms).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from glm53.support.cluster import Cluster

# The router's histograms that split a request's TTFT: (metric, scale to print, label).
TTFT_SPLIT = (("sglang:queue_time_seconds", 1e3, "queue ms"),
              ("sglang:kv_transfer_bootstrap_ms", 1, "bootstrap ms"),
              ("sglang:kv_transfer_latency_ms", 1, "transfer ms"),
              ("sglang:time_to_first_token_seconds", 1e3, "router TTFT ms"),
              ("sglang:kv_transfer_total_mb", 1, "MB moved"))


def on_one_gpu(c: Cluster, mem_fraction: float = 0.3) -> None:
    """Both instances on GPU 0 in bf16, each with its share of the memory."""
    c.cfg["defaults"].update(device="cuda", dtype="bfloat16", chunked_prefill_size=8192)
    for role in ("prefill", "decode"):
        c.cfg[role][0].update(devices=[0], mem_fraction_static=mem_fraction)
    c.config_path.write_text(yaml.safe_dump(c.cfg))


def start(cache: Path, speculative: dict | None, device: str = "cpu") -> Cluster:
    """One 1P1D deployment of the embedded model, prefix cache off (every run of a prompt
    prefills it), on GPU 0 for `device` "cuda"."""
    c = Cluster(Path(tempfile.mkdtemp()), cache, speculative=speculative)
    c.cfg["defaults"]["disable_radix_cache"] = True
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    if device == "cuda":
        on_one_gpu(c)
    return c.start()


def stream_events(http: httpx.Client, url: str, body: dict) -> Iterator[tuple[float, dict]]:
    """(arrival time, event) of each event of one streamed /generate request (`stream` set here)."""
    with http.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                yield time.perf_counter(), json.loads(line[5:])


def stream_ttft(http: httpx.Client, url: str, text: str, new: int) -> tuple[float, dict]:
    """(client TTFT in seconds, the last event's meta_info) of one streamed greedy request of
    `new` tokens, EOS ignored."""
    body = {"text": text, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    first, meta = None, {}
    for now, ev in stream_events(http, url, body):
        if first is None and ev.get("output_ids"):
            first = now - t0
        meta = ev.get("meta_info", meta)
    if first is None:
        raise RuntimeError(f"no token streamed: {meta}")
    return first, meta


def rotated_passes(rounds: int, texts: list[str], names: list[str]) -> Iterator[tuple[str, str]]:
    """(deployment, prompt) for every pass, prompt and deployment: each prompt goes to every
    deployment back to back, starting one deployment later each time, so a shared CPU's drift
    moves them alike and per-prompt ratios hold. A pass marks each prompt at its start (a suffix
    would leave the prefix cache every earlier pass's prompt)."""
    for r in range(rounds):
        for i, t in enumerate(texts):
            k = (r * len(texts) + i) % len(names)
            for n in names[k:] + names[:k]:
                yield n, f"# pass {r}\n{t}"


def generate(http: httpx.Client, url: str, ids: list[int], new: int) -> tuple[float, dict]:
    """(seconds, response) of one greedy /generate request of `new` tokens, EOS ignored."""
    t0 = time.perf_counter()
    r = http.post(f"{url}/generate", timeout=600, json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


@dataclass
class PDRun:
    """One deployment's figures: one at a time (decode rate, prefill and transfer left out) and
    `concurrent` at once (output tokens / wall time); τ = tokens after the first per verify."""

    rate1: float
    tau1: float | None
    rate_n: float
    tau_n: float | None
    outputs: list[list[int]] = field(default_factory=list)


def measure(c: Cluster, one_at_a_time: list[list[int]], at_once: list[list[int]], new: int) -> PDRun:
    """One at a time: each prompt twice, max_new_tokens 1 and `new`; the decode rate is
    (new − 1) / (t_new − t_1), so it leaves out prefill and transfer (run the instance without its
    prefix cache, or the second run skips the prefill the first paid). At once: every prompt of
    `at_once` in its own thread and client. `outputs`: every output, in that order."""
    clients = [httpx.Client() for _ in range(max(1, len(at_once)))]
    http = clients[0]
    try:
        generate(http, c.url, one_at_a_time[0], 8)  # warm-up
        dec_t = toks = verify = 0.0
        outs = []
        for p in one_at_a_time:
            t1, _ = generate(http, c.url, p, 1)
            tn, r = generate(http, c.url, p, new)
            dec_t += tn - t1
            toks += r["meta_info"]["completion_tokens"] - 1
            verify += r["meta_info"].get("spec_verify_ct", 0)
            outs.append(r["output_ids"])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(at_once)) as ex:
            res = [r for _, r in ex.map(lambda hp: generate(hp[0], c.url, hp[1], new), zip(clients, at_once))]
        wall = time.perf_counter() - t0
    finally:
        for h in clients:
            h.close()
    tok_n = sum(r["meta_info"]["completion_tokens"] for r in res)
    ver_n = sum(r["meta_info"].get("spec_verify_ct", 0) for r in res)
    return PDRun(toks / dec_t, toks / verify if verify else None, tok_n / wall,
                 (tok_n - len(res)) / ver_n if ver_n else None, outs + [r["output_ids"] for r in res])


def table_header(name: str, concurrent: int) -> str:
    """The header of `table_row`'s table (same column widths)."""
    return (f"{name:<10} | {'batch 1 decode tok/s':>26} | {'tau':>5} | {'speed-up':>8} | "
            f"{f'batch {concurrent} tok/s':>20} | {'tau':>5} | {'speed-up':>8}")


def table_row(name: str, run: PDRun, base: PDRun, ref: list[list[int]]) -> str:
    """One row of the drafts' tables: rates, τ and speed-ups over `base`; flags outputs that differ."""
    tau1 = f"{run.tau1:.2f}" if run.tau1 else "-"
    tau_n = f"{run.tau_n:.2f}" if run.tau_n else "-"
    return (f"{name:<10} | {run.rate1:26.1f} | {tau1:>5} | {run.rate1 / base.rate1:7.2f}x | {run.rate_n:20.1f} | "
            f"{tau_n:>5} | {run.rate_n / base.rate_n:7.2f}x" + ("" if run.outputs == ref else "  OUTPUT DIFFERS FROM OFF"))


def measure_deployment(cache: Path, speculative: dict | None, device: str, one_at_a_time: list[list[int]],
                       at_once: list[list[int]], new: int) -> PDRun:
    """`measure` on a deployment of its own (`start`), stopped afterwards."""
    c = start(cache, speculative, device)
    try:
        return measure(c, one_at_a_time, at_once, new)
    finally:
        c.stop()


def router_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each TTFT_SPLIT histogram, from the router's /metrics."""
    out: dict[str, tuple[float, float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for m, _, _ in TTFT_SPLIT:
            for part, i in (("_sum", 0), ("_count", 1)):
                if line.startswith(m + part):
                    cur = list(out.get(m, (0.0, 0.0)))
                    cur[i] += float(line.rsplit(" ", 1)[1])
                    out[m] = (cur[0], cur[1])
    return out


def split_means(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]] | None = None) -> str:
    """The TTFT split's means between two `router_sums` readings (from the start without `before`)."""
    before = before or {}
    parts = []
    for m, scale, label in TTFT_SPLIT:
        s, n = after.get(m, (0.0, 0.0))
        s0, n0 = before.get(m, (0.0, 0.0))
        if n - n0:
            parts.append(f"{label} {(s - s0) / (n - n0) * scale:.1f}")
    return ", ".join(parts)

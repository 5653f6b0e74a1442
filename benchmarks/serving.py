"""Serving benchmark: random token-id prompts streamed through the OpenAI completions API at a
sweep of concurrencies; prints requests/s, output tokens/s, TTFT and ITL p50/p99 (client-side).

    python benchmarks/serving.py                      # starts the embedded 1P1D cluster itself
    python benchmarks/serving.py --url http://127.0.0.1:30000 --model glm-5-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False}
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if d.get("choices") and d["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
    if not stamps:
        return {"ok": False}
    return {"ok": True, "ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": len(stamps), "e2e": stamps[-1] - t0, "stamps": stamps}


async def sweep_point(url: str, model: str, concurrency: int, n_req: int, in_len: int, out_len: int,
                      vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(in_len)] for _ in range(n_req)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as http:
        async def run(p):
            async with sem:
                return await one(http, url, model, p, out_len)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    ok = [r for r in res if r["ok"]]
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    # Intervals that start once the point's last first token has arrived: no prefill runs any
    # more (with as many requests as the concurrency), so these time decode steps alone.
    last_first = max((r["stamps"][0] for r in ok), default=0.0)
    quiet = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:]) if a >= last_first]
    return {"concurrency": concurrency, "ok": len(ok), "n": n_req, "req_s": len(ok) / wall,
            "out_tok_s": sum(r["tokens"] for r in ok) / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(itl, 0.5), "itl_p90": pct(itl, 0.9), "itl_p99": pct(itl, 0.99), "itl_after_prefills_p50": pct(quiet, 0.5),
            "itl_after_prefills_n": len(quiet)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--model", default="glm-5-tiny")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-point", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4000)
    args = ap.parse_args()
    cluster = None
    url = args.url
    if url is None:
        from tests.e2e.cluster import Cluster

        tmp = Path(tempfile.mkdtemp())
        cluster = Cluster(tmp, Path.home() / ".cache" / "glm53-serve").start()
        url = cluster.url
    try:
        rows = []
        for c in args.concurrency:
            n = max(args.requests_per_point, c)
            rows.append(asyncio.run(sweep_point(url, args.model, c, n, args.input_len, args.output_len, args.vocab, c)))
        print(f"input {args.input_len} tokens, output {args.output_len} tokens, random token ids")
        print("ITL after prefills: intervals that start after the point's last first token (decode steps alone)")
        print(f"{'conc':>5} {'ok':>7} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
              f"{'ITL p99':>8} {'ITL after prefills p50':>23}")
        for r in rows:
            print(f"{r['concurrency']:>5} {r['ok']:>3}/{r['n']:<3} {r['req_s']:8.2f} {r['out_tok_s']:10.1f} "
                  f"{r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:7.0f}ms {r['itl_p50'] * 1e3:6.0f}ms "
                  f"{r['itl_p99'] * 1e3:6.0f}ms {r['itl_after_prefills_p50'] * 1e3:13.1f}ms ({r['itl_after_prefills_n']})")
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()

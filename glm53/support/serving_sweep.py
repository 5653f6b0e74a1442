"""The serving benchmark's client: random token-id prompts streamed through the OpenAI
completions API at one concurrency (`sweep_point`): requests/s, output tokens/s, TTFT and ITL
percentiles (client-side), and the ITL after every prefill is done. Used by benchmarks/serving.py,
benchmarks/gpu_e2e.py and benchmarks/router_stream.py.

Tokens are the usage chunk's `completion_tokens` (a speculative step, or a `stream_interval` above
one, streams several tokens in one chunk); ITL is the time between streamed chunks, as vLLM's and
SGLang's serving benchmarks measure it, and TPOT the time per output token after the first,
(last chunk − first chunk) / (tokens − 1), per request.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx


WORST_KEPT = 200  # longest intervals a point reports with their place


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = None
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
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
    if not stamps or tokens is None:
        return {"ok": False}
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else float("nan")
    return {"ok": True, "ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens, "chunks": len(stamps), "tpot": tpot, "e2e": stamps[-1] - t0, "stamps": stamps}


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
    # The longest intervals, each with where it sat (request, token index: 0 = first token to second)
    # and when it began (perf_counter: comparable with the server's clocks on this host).
    worst = sorted(((b - a, i, k, a) for i, r in enumerate(ok) for k, (a, b) in enumerate(zip(r["stamps"], r["stamps"][1:]))),
                   reverse=True)[:WORST_KEPT]
    return {"concurrency": concurrency, "ok": len(ok), "n": n_req, "req_s": len(ok) / wall,
            "out_tok_s": sum(r["tokens"] for r in ok) / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(itl, 0.5), "itl_p90": pct(itl, 0.9), "itl_p99": pct(itl, 0.99),
            "tpot_p50": pct([r["tpot"] for r in ok if r["tokens"] > 1], 0.5),
            "itl_after_prefills_p50": pct(quiet, 0.5), "itl_after_prefills_n": len(quiet),
            "itl_worst": [list(w) for w in worst]}

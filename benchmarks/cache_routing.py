"""Cache-aware routing against least_loaded with two prefill instances: multi-turn chat sessions
side by side (each turn the whole history plus a new user message, as chat clients send it).
Prints, per policy, the prefix-cache hit rate (cached / prompt tokens of turns after the first)
and TTFT p50 of those turns, and the ratios, measured in one run.

    PYTHONPATH=. python benchmarks/cache_routing.py [--sessions 8] [--turns 4] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from glm53.support.cluster import Cluster

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def message(session: int, turn: int, words: int) -> str:
    return " ".join(WORDS[(session * 7 + turn * 3 + i * (session + 1)) % len(WORDS)] for i in range(words))


def chat_turn(url: str, messages: list[dict], max_tokens: int) -> tuple[str, float, int, int]:
    """(reply, TTFT, prompt tokens, cached tokens) of one streamed chat turn."""
    t0, ttft, text, usage = time.monotonic(), None, "", {}
    body = {"model": "glm-5-tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text += piece
            usage = ev.get("usage") or usage
    return text, ttft if ttft is not None else time.monotonic() - t0, usage["prompt_tokens"], \
        usage["prompt_tokens_details"]["cached_tokens"]


def run_policy(policy: str, args: argparse.Namespace, cache: Path) -> dict:
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(Path(d), cache, router={"policy": policy}).add_prefill("p1").start()
        try:
            def session(s: int) -> list[tuple[float, int, int]]:
                msgs = [{"role": "system", "content": message(s, 99, args.system_words)}]
                out = []
                for t in range(args.turns):
                    msgs.append({"role": "user", "content": message(s, t, args.user_words)})
                    reply, ttft, prompt, cached = chat_turn(c.url, msgs, args.max_tokens)
                    msgs.append({"role": "assistant", "content": reply})
                    if t > 0:
                        out.append((ttft, prompt, cached))
                return out

            with cf.ThreadPoolExecutor(args.concurrency) as ex:
                later = [x for per in ex.map(session, range(args.sessions)) for x in per]
        finally:
            c.stop()
    return {"hit_rate": sum(x[2] for x in later) / sum(x[1] for x in later),
            "ttft_p50_ms": 1000 * statistics.median(x[0] for x in later), "turns": len(later)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--user-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "glm53-bench-cache")
    args = ap.parse_args()
    res = {p: run_policy(p, args, args.cache) for p in ("least_loaded", "cache_aware")}
    for p, r in res.items():
        print(f"{p:13s} hit rate {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50_ms']:.1f} ms  ({r['turns']} later turns)")
    a, b = res["cache_aware"], res["least_loaded"]
    print(f"cache_aware / least_loaded: hit rate {a['hit_rate'] / max(b['hit_rate'], 1e-9):.2f}x, "
          f"TTFT p50 {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x")


if __name__ == "__main__":
    main()

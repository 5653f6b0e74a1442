"""Serving benchmark: random token-id prompts streamed through the OpenAI completions API at a
sweep of concurrencies; prints requests/s, output tokens/s, TTFT, TPOT and ITL (client-side).

    PYTHONPATH=. python benchmarks/serving.py         # starts the embedded 1P1D cluster itself
    PYTHONPATH=. python benchmarks/serving.py --url http://127.0.0.1:30000 --model glm-5-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from glm53.support.serving_sweep import sweep_point


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
        from glm53.support.cluster import Cluster

        tmp = Path(tempfile.mkdtemp())
        cluster = Cluster(tmp, Path.home() / ".cache" / "glm53-serve").start()
        url = cluster.url
    try:
        rows = []
        for c in args.concurrency:
            n = max(args.requests_per_point, c)
            rows.append(asyncio.run(sweep_point(url, args.model, c, n, args.input_len, args.output_len, args.vocab, c)))
        print(f"input {args.input_len} tokens, output {args.output_len} tokens, random token ids")
        print("ITL: between streamed chunks (a speculative step streams several tokens in one); TPOT: per output "
              "token after the first; ITL after prefills: intervals that start after the point's last first token")
        print(f"{'conc':>5} {'ok':>7} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'ITL after prefills p50':>23}")
        for r in rows:
            print(f"{r['concurrency']:>5} {r['ok']:>3}/{r['n']:<3} {r['req_s']:8.2f} {r['out_tok_s']:10.1f} "
                  f"{r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:7.0f}ms {r['tpot_p50'] * 1e3:7.1f}ms "
                  f"{r['itl_p50'] * 1e3:6.0f}ms {r['itl_p99'] * 1e3:6.0f}ms "
                  f"{r['itl_after_prefills_p50'] * 1e3:13.1f}ms ({r['itl_after_prefills_n']})")
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()

"""What the draft KV costs through the whole PD pipeline (router, prefill, UCX transfer, decode) on
the embedded trained pair, greedy, block 16: TTFT without speculation, with DFlash and its draft
KV sent to decode (`speculative.draft_kv_transfer: true`, the default), and with DFlash and the
draft KV not sent (decode then drafts without the prompt's context); and the τ the opt-out costs.

    PYTHONPATH=. python benchmarks/draft_kv_cost.py [--prompts 8] [--rounds 3]

Prompts: the first 1,500 characters of every 25th module of this Python's standard library (up to
`--prompts`). Each request streams; TTFT = the first token's arrival at the client after the send,
the median over `--rounds` passes over the prompts (each pass marked at the prompt's start, so no
prefix is cached; one warm-up request first). `draft_kv_split.py` splits the same TTFT request by
request into the router's parts. The three deployments run at once and each prompt
goes to all three back to back, so the TTFT ratios are per request, under the same load; the
router's own split of TTFT (queue, transfer bootstrap and latency, MB moved) is printed beside.
τ = tokens committed after the first (which prefill samples) per verify step. Target (issue 31
item 7): the draft-KV work adds ≤ 15 % to TTFT.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import tempfile
from pathlib import Path

import httpx

from glm53.support.cluster import Cluster
from glm53.support.pd_bench import rotated_passes, router_sums, split_means, stream_ttft

SPEC = {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash", "num_draft_tokens": 16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args()
    src = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(errors="ignore")[:1500] for f in sorted(src.glob("*.py"))[::25][: a.prompts]]
    cache = Path(tempfile.mkdtemp(prefix="kvcost-"))
    configs = {"no speculation": None, "DFlash, draft KV sent": {**SPEC, "draft_kv_transfer": True},
               "DFlash, draft KV not sent": {**SPEC, "draft_kv_transfer": False}}
    clusters: dict[str, Cluster] = {}
    try:
        for name, spec in configs.items():
            clusters[name] = Cluster(Path(tempfile.mkdtemp()), cache, speculative=spec).start()
        ttft: dict[str, list[float]] = {n: [] for n in configs}
        toks = {n: 0 for n in configs}
        verify = {n: 0 for n in configs}
        with httpx.Client() as http:
            for n, c in clusters.items():
                stream_ttft(http, c.url, "# warm-up\n" + texts[0], 8)
            # The ratios are taken prompt by prompt (pd_bench.rotated_passes says why).
            for n, text in rotated_passes(a.rounds, texts, list(configs)):
                first, meta = stream_ttft(http, clusters[n].url, text, a.new)
                ttft[n].append(first)
                toks[n] += meta["completion_tokens"] - 1
                verify[n] += meta.get("spec_verify_ct", 0)
        split = {n: split_means(router_sums(c.url)) for n, c in clusters.items()}  # the warm-up included
    finally:
        for c in clusters.values():
            c.stop()
    base = ttft["no speculation"]
    for n in configs:
        rel = ""
        if n != "no speculation":
            ratio = statistics.median(x / b for x, b in zip(ttft[n], base))
            rel = f" ({(ratio - 1) * 100:+.0f} % vs no speculation, median of the per-request ratios)"
        tau = f", {verify[n]} verify steps, tau {toks[n] / verify[n]:.2f}" if verify[n] else ""
        print(f"{n}: TTFT median {statistics.median(ttft[n]) * 1e3:.1f} ms over {len(ttft[n])} requests{rel}; "
              f"{toks[n]} tokens after the first{tau}\n    router means: {split[n]}", flush=True)


if __name__ == "__main__":
    main()

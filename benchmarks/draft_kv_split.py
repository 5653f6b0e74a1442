"""Where the served TTFT goes with DFlash's draft KV (issue 31, item 7), request by request: the
deployments of benchmarks/draft_kv_cost.py (no speculation; DFlash block 16 with the draft KV sent;
DFlash with it not sent), the same 1,500-character stdlib prompts, each prompt to the three back to
back in a rotating order, and for every request the router's own split read around it alone:
queue, transfer bootstrap, transfer (decode's clock from the bootstrap to the last page and the
commit record: prefill's chunked forward and the UCX writes), MB moved and router TTFT; the rest,
router TTFT − bootstrap − transfer, is the router's dispatch to decode's admission plus decode's
adoption to the first token event and the router's own handling (the queue overlaps the transfer
clock, so it is not subtracted). Each prompt starts with its pass number, so the prefix cache never
holds it. Before the deployments start, the prefill forward alone (in this process,
one torch thread, 64-token chunks as the served prefill runs them) with and without the draft.

    PYTHONPATH=. python benchmarks/draft_kv_split.py [--prompts 8] [--rounds 2]

Each figure: the median over requests, and beside each config's the median of the per-request
ratio to no speculation with its interquartile range (the spread the ≤ 15 % target is read against).
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx
import torch

from glm53.models import ModelRunner, SeqChunk
from glm53.server.embedded_model import ensure_embedded_draft, ensure_embedded_model
from glm53.support.cluster import Cluster
from glm53.support.pd_bench import TTFT_SPLIT, rotated_passes, router_sums, stream_ttft

SPEC = {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash", "num_draft_tokens": 16}
CONFIGS = {"off": None, "on, sent": {**SPEC, "draft_kv_transfer": True},
           "on, not sent": {**SPEC, "draft_kv_transfer": False}}
FIELDS = ("client TTFT ms", "router TTFT ms", "queue ms", "bootstrap ms", "transfer ms", "rest ms", "MB moved")


def one_request(http: httpx.Client, url: str, text: str, new: int) -> tuple[dict[str, float], dict]:
    """One request's figures (FIELDS): the router's histograms read just before and after it."""
    before = router_sums(url)
    first, meta = stream_ttft(http, url, text, new)
    time.sleep(0.05)  # the router observes TTFT as the token passes; let the last histogram land
    after = router_sums(url)
    out = {"client TTFT ms": first * 1e3}
    for m, scale, label in TTFT_SPLIT:
        s, n = after.get(m, (0.0, 0.0))
        s0, n0 = before.get(m, (0.0, 0.0))
        out[label] = (s - s0) / (n - n0) * scale if n - n0 else float("nan")
    # The queue ends once both instances admitted the room, so it overlaps decode's transfer clock
    # (which starts at decode's admission): the rest leaves the queue in.
    out["rest ms"] = out["router TTFT ms"] - out["bootstrap ms"] - out["transfer ms"]
    return out, meta


def prefill_forward_ms(n_tokens: int, iters: int) -> tuple[float, float, list[float]]:
    """(median ms plain, with the draft, per-round ratios) of one `n_tokens` prompt's chunked
    prefill (64-token chunks), thread CPU time, plain and draft back to back in each round."""
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model, draft = ensure_embedded_model(), ensure_embedded_draft()
    runners = [ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False),
               ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False, draft_dir=draft)]
    prompt = torch.randint(10, 4000, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    pages = list(range(-(-(n_tokens + 32) // 16)))

    def run(r: ModelRunner) -> float:
        t0 = time.thread_time()
        for s in range(0, n_tokens, 64):
            r.forward([SeqChunk(prompt[s: s + 64], s, pages)])
        return (time.thread_time() - t0) * 1e3

    for r in runners:
        run(r)  # warm-up
    tp, td = [], []
    for _ in range(iters):
        tp.append(run(runners[0]))
        td.append(run(runners[1]))
    return statistics.median(tp), statistics.median(td), [d / p for d, p in zip(td, tp)]


def quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.2f} [{q[0]:.2f}, {q[2]:.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--forward-iters", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=500, help="the in-process prefill's length")
    a = ap.parse_args()
    tp, td, rs = prefill_forward_ms(a.prompt_tokens, a.forward_iters)
    print(f"prefill forward alone, {a.prompt_tokens} tokens in 64-token chunks: {tp:.1f} ms plain, {td:.1f} ms with "
          f"the draft KV; ratio median [IQR] {quartiles(rs)}", flush=True)
    src = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(errors="ignore")[:1500] for f in sorted(src.glob("*.py"))[::25][: a.prompts]]
    cache = Path(tempfile.mkdtemp(prefix="kvsplit-"))
    clusters: dict[str, Cluster] = {}
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in CONFIGS}
    prompt_tokens = []
    try:
        for name, spec in CONFIGS.items():
            clusters[name] = Cluster(Path(tempfile.mkdtemp()), cache, speculative=spec).start()
        with httpx.Client() as http:
            for n, c in clusters.items():
                for w in range(2):
                    stream_ttft(http, c.url, f"# warm-up {w}\n" + texts[0], 8)
            for n, text in rotated_passes(a.rounds, texts, list(CONFIGS)):
                row, meta = one_request(http, clusters[n].url, text, a.new)
                rows[n].append(row)
                if n == "off":
                    prompt_tokens.append(meta.get("prompt_tokens", 0))
    finally:
        for c in clusters.values():
            c.stop()
    print(f"{len(rows['off'])} requests per config; prompt tokens median {statistics.median(prompt_tokens)}")
    print(f"{'config':<14}| " + " | ".join(f"{f:>15}" for f in FIELDS))
    for n in CONFIGS:
        print(f"{n:<14}| " + " | ".join(f"{statistics.median(r[f] for r in rows[n]):15.1f}" for f in FIELDS))
    for n in list(CONFIGS)[1:]:
        parts = []
        for f in ("client TTFT ms", "router TTFT ms", "transfer ms", "rest ms"):
            parts.append(f"{f} x{quartiles([r[f] / b[f] for r, b in zip(rows[n], rows['off'])])}")
        print(f"{n} / off, per request, median [IQR]: " + "; ".join(parts))


if __name__ == "__main__":
    main()

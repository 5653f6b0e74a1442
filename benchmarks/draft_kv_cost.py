"""What the draft KV costs through the whole PD pipeline (router, prefill, UCX transfer, decode) on
the embedded trained pair, greedy, block 16: TTFT without speculation, with DFlash and its draft
KV sent to decode (`speculative.draft_kv_transfer: true`, the default), and with DFlash and the
draft KV not sent (decode then drafts without the prompt's context); and the τ the opt-out costs.

    PYTHONPATH=. python benchmarks/draft_kv_cost.py [--prompts 8] [--rounds 2]

Prompts: the first 1,500 characters of every 25th module of this Python's standard library (up to
`--prompts`). Each request streams; TTFT = the first token's arrival at the client after the send,
the median over `--rounds` passes over the prompts (each pass its own distinct suffix, so no
prefix is cached; one warm-up request first). τ = tokens committed after the first (which
prefill samples) per verify step. Target (issue 31 item 7): the draft-KV work adds ≤ 15 % to TTFT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

from glm53.support.cluster import Cluster

SPEC = {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash", "num_draft_tokens": 16}


def stream(http: httpx.Client, url: str, text: str, new: int) -> tuple[float, dict]:
    """(TTFT in seconds, the last event's meta_info) of one streamed greedy request."""
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    first, meta = None, {}
    with http.stream("POST", f"{url}/generate", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if first is None and ev.get("output_ids"):
                first = time.perf_counter() - t0
            meta = ev.get("meta_info", meta)
    if first is None:
        raise RuntimeError(f"no token streamed: {meta}")
    return first, meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args()
    src = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(errors="ignore")[:1500] for f in sorted(src.glob("*.py"))[::25][: a.prompts]]
    cache = Path(tempfile.mkdtemp(prefix="kvcost-"))
    ttft: dict[str, float] = {}
    for name, spec in (("no speculation", None), ("DFlash, draft KV sent", {**SPEC, "draft_kv_transfer": True}),
                       ("DFlash, draft KV not sent", {**SPEC, "draft_kv_transfer": False})):
        c = Cluster(Path(tempfile.mkdtemp()), cache, speculative=spec).start()
        try:
            with httpx.Client() as http:
                stream(http, c.url, "# warm-up\n" + texts[0], 8)
                times, toks, verify = [], 0, 0
                for r in range(a.rounds):
                    for t in texts:
                        first, meta = stream(http, c.url, f"{t}\n# pass {r}\n", a.new)
                        times.append(first)
                        toks += meta["completion_tokens"] - 1
                        verify += meta.get("spec_verify_ct", 0)
            ttft[name] = statistics.median(times)
            rel = f" ({(ttft[name] / ttft['no speculation'] - 1) * 100:+.0f} % vs no speculation)" if spec else ""
            tau = f", {verify} verify steps, tau {toks / verify:.2f}" if verify else ""
            print(f"{name}: TTFT median {ttft[name] * 1e3:.1f} ms over {len(times)} requests{rel}; "
                  f"{toks} tokens after the first{tau}", flush=True)
        finally:
            c.stop()


if __name__ == "__main__":
    main()

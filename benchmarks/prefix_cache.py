"""Prefix cache: time to first token of prompts that share a long prefix (a system prompt, earlier
turns), served with prefill's prefix cache off and on, in one run.

    PYTHONPATH=. python benchmarks/prefix_cache.py [--prefix 2048] [--tail 32] [--requests 8]
    PYTHONPATH=. python3 benchmarks/prefix_cache.py --device cuda --model DIR   # e.g. the GLM-5 slice on a GPU

Each request is the shared prefix plus its own random tail, sent one at a time, with one new
token (the latency is prefill, the KV transfer and the first token: TTFT). Printed per setting:
the median latency, the tokens the response reports as cached, and the ratio off / on. The
first request of each setting is a warm-up (it fills the cache when on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import torch


def run(url: str, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    lat, cached = [], []
    with httpx.Client(timeout=600) as http:
        for p in prompts:
            t = time.perf_counter()
            r = http.post(f"{url}/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": 1, "temperature": 0, "ignore_eos": True}})
            r.raise_for_status()
            lat.append(time.perf_counter() - t)
            cached.append(r.json()["meta_info"]["cached_tokens"])
    return lat, cached


def main() -> None:
    from glm53.models import GlmConfig
    from glm53.server.embedded_model import ensure_embedded_model
    from glm53.support.gpu_server import Server, cluster_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024, help="chunked_prefill_size")
    ap.add_argument("--out", default=None, help="JSON report")
    a = ap.parse_args()
    model = Path(a.model) if a.model else ensure_embedded_model()
    vocab = GlmConfig.from_dir(model).vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, vocab - 10, (a.prefix,), generator=g).tolist()
    prompts = [prefix + torch.randint(10, vocab - 10, (a.tail,), generator=g).tolist() for _ in range(a.requests + 1)]
    cuda = a.device == "cuda"
    report = {"prefix": a.prefix, "tail": a.tail, "requests": a.requests, "device": a.device, "model": str(model)}
    workdir = Path(a.out).parent if a.out else Path("/tmp")
    for cache in (False, True):
        cfg = cluster_config(str(model), "bfloat16" if cuda else "float32", True, [0] * 5, a.prefix + a.tail + 64,
                             a.device)
        for e in (cfg["prefill"][0], cfg["decode"][0]):
            e.update(chunked_prefill_size=a.chunk, disable_radix_cache=not cache)
        tag = f"prefix-cache-{'on' if cache else 'off'}"
        with Server(cfg, workdir, tag) as s:
            lat, cached = run(s.url, prompts)
        p50 = statistics.median(lat[1:])
        report[tag] = {"ttft_p50_s": p50, "ttft_s": lat, "cached_tokens": cached}
        print(f"{tag}: TTFT p50 {p50 * 1e3:8.1f} ms, cached tokens per request {cached[1:]}", flush=True)
    off, on = report["prefix-cache-off"]["ttft_p50_s"], report["prefix-cache-on"]["ttft_p50_s"]
    report["speedup"] = off / on
    print(f"{a.prefix}-token shared prefix + {a.tail}-token tails: {off / on:.2f}x faster to the first token", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

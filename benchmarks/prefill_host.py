"""Where a prefill forward spends host time on a GPU: every host sync it makes (with the Python
line that caused it) and its wall time against its GPU time, for a short chunk over a long cached
context (the prefix-cache case) and a long chunk.

    PYTHONPATH=. python3 benchmarks/prefill_host.py --slice DIR [--ctx 8192] [--chunks 64 4096]

Syncs are found with `torch.cuda.set_sync_debug_mode("warn")`: each warning is printed once per
call site, with the innermost frames of this repository. Needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from glm53.models import ModelRunner, SeqChunk

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice", required=True)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    pages = -(-(a.ctx + max(a.chunks)) // 64) + 1
    runner = ModelRunner.from_dir(a.slice, page_size=64, num_pages=pages, device="cuda", progress=False)
    vocab = runner.model.cfg.vocab_size
    table = list(range(pages))
    ctx_ids = torch.randint(10, vocab - 10, (a.ctx,)).tolist()
    for i in range(0, a.ctx, 4096):  # the cached context, written by ordinary prefill chunks
        runner.forward([SeqChunk(ctx_ids[i : i + 4096], i, table)])
    torch.cuda.synchronize()

    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if str(ROOT) in f.filename]
        site = " <- ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.line}" for f in frames[-3:][::-1])
        sites[site] += 1

    for n in a.chunks:
        ids = torch.randint(10, vocab - 10, (n,)).tolist()
        chunk = [SeqChunk(ids, a.ctx, table)]
        runner.forward(chunk)
        torch.cuda.synchronize()
        sites.clear()
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            runner.forward(chunk)
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        print(f"chunk {n} at context {a.ctx}: {sum(sites.values())} host syncs at {len(sites)} sites", flush=True)
        for site, k in sites.most_common():
            print(f"  {k:3d}x {site}", flush=True)
        walls, gpus = [], []
        for _ in range(a.iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            s.record()
            runner.forward(chunk)
            e.record()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
            gpus.append(s.elapsed_time(e) / 1e3)
        print(f"  wall {statistics.median(walls) * 1e3:.2f} ms, GPU (events) {statistics.median(gpus) * 1e3:.2f} ms",
              flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            runner.forward(chunk)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48),
              flush=True)


if __name__ == "__main__":
    main()

"""Model-core throughput on this machine: prefill tokens/s and batched decode tokens/s through
the paged cache (torch reference path). Compares decode at batch B with B x batch-1 in the same
run, so the printed ratio is the batching gain.

    PYTHONPATH=. python benchmarks/model_cpu.py [--model DIR]   (default: the oracle-sized tiny config)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk


def oracle_checkpoint(path: str) -> None:
    from glm53.support.oracle import make_checkpoint  # transformers: test-only dependency

    make_checkpoint(path, seed=0)


def bench_prefill(runner: ModelRunner, allocator: PageAllocator, n_tokens: int, reps: int = 3) -> float:
    ids = torch.randint(0, runner.cfg.vocab_size, (n_tokens,)).tolist()
    best = float("inf")
    for _ in range(reps):
        pages = allocator.alloc(runner.pages_needed(n_tokens))
        t = time.perf_counter()
        runner.forward([SeqChunk(ids, 0, pages)])
        best = min(best, time.perf_counter() - t)
        allocator.free(pages)
    return n_tokens / best


def bench_decode(runner: ModelRunner, allocator: PageAllocator, batch: int, ctx: int, steps: int) -> float:
    pages = [allocator.alloc(runner.pages_needed(ctx + steps)) for _ in range(batch)]
    prompts = [torch.randint(0, runner.cfg.vocab_size, (ctx,)).tolist() for _ in range(batch)]
    runner.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)])
    tok = [p[-1] for p in prompts]
    t = time.perf_counter()
    for s in range(steps):
        logits = runner.forward([SeqChunk([tok[i]], ctx + s, pages[i]) for i in range(batch)])
        tok = [int(lg[-1].argmax()) for lg in logits]
    dt = time.perf_counter() - t
    for pg in pages:
        allocator.free(pg)
    return batch * steps / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (oracle_checkpoint(tmp) or tmp)
        runner = ModelRunner.from_dir(model, page_size=16, num_pages=4096, progress=False)
        allocator = PageAllocator(4096)
        print(f"threads={torch.get_num_threads()} layers={runner.cfg.num_hidden_layers} hidden={runner.cfg.hidden_size}")
        for n in (128, 512):
            print(f"prefill {n:5d} tokens: {bench_prefill(runner, allocator, n):9.1f} tok/s")
        b1 = bench_decode(runner, allocator, 1, args.ctx, args.steps)
        print(f"decode batch  1 (ctx {args.ctx}): {b1:9.1f} tok/s")
        b16 = bench_decode(runner, allocator, 16, args.ctx, args.steps)
        print(f"decode batch 16 (ctx {args.ctx}): {b16:9.1f} tok/s  ({b16 / b1:.1f}x batch 1)")


if __name__ == "__main__":
    main()

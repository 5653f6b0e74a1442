"""DSA top-k at decode rows: the one-launch rank kernel (`topk_triton._rank_kernel`, B·L² compares
over the SMs) against the three launches (bracket, scan, finish), GLM-5's k = 2,048, paged output
as the decode step asks for it.

First every variant is checked against the reference on fresh random rows (the reference's output
exactly, its order too); a mismatch is printed and the run exits 1. Then each figure is the GPU
time of one call inside a CUDA graph of `--calls` calls on different rows (each launched early,
as in the step), with the three launches' time over it beside it.

    PYTHONPATH=. python3 benchmarks/topk_rank.py [--shapes 1x4224 4x4224 1x8256] [--calls 8]
"""

from __future__ import annotations

import argparse
import sys

import torch

from glm53.kernels import topk_triton as tt
from glm53.kernels.topk import dsa_topk_reference, positions_to_slots
from glm53.support.cuda_timing import graph_ms

K, PAGE = 2048, 64
# (tile, block, warps, blocks in flight); the first is the shipped default
VARIANTS = [(tt.RANK_TILE, tt.RANK_BLOCK, tt.RANK_WARPS, tt.RANK_PREFETCH), (32, 128, 4, 1), (32, 128, 4, 2),
            (16, 256, 4, 2), (64, 256, 8, 2), (32, 512, 8, 2), (16, 128, 2, 2)]


def knobs(v: tuple[int, int, int, int]) -> dict:
    return dict(tile=v[0], block=v[1], num_warps=v[2], prefetch=v[3])


def page_table(B: int, L: int, dev: str) -> torch.Tensor:
    pages = -(-L // PAGE)
    return torch.stack([torch.randperm(4 * pages, device=dev)[:pages] for _ in range(B)]).int()


def exact(shapes: list[tuple[int, int]], dev: str) -> int:
    bad = 0
    for B, L in shapes:
        for v in dict.fromkeys(VARIANTS):
            for kind in ("randn", "ties"):
                x = torch.randn(B, L, device=dev)
                if kind == "ties":
                    x = torch.randint(0, 3, (B, L), device=dev).float()
                lens = torch.randint(1, L + 1, (B,), dtype=torch.int32, device=dev)
                lens[0] = L
                pt = page_table(B, L, dev)
                out = torch.empty(B, K, dtype=torch.int32, device=dev)
                tt.run_rank(x, lens, out, pt, PAGE, **knobs(v))
                want = positions_to_slots(dsa_topk_reference(x, lens, K), pt, PAGE)
                if not torch.equal(out, want):
                    bad += 1
                    print(f"MISMATCH {B}x{L} {kind} {v}: {(out != want).sum().item()} slots", flush=True)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x4224", "2x4224", "4x4224", "1x2112", "1x8256", "4x8256",
                                                    "8x4224"])
    ap.add_argument("--calls", type=int, default=8)
    a = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    shapes = [tuple(int(t) for t in s.split("x")) for s in a.shapes]
    bad = exact(shapes, dev)
    print(f"exactness: {bad} mismatches", flush=True)
    if bad:
        sys.exit(1)
    names = [f"{t}/{b}/{w}/{p}" for t, b, w, p in VARIANTS]
    print("µs a call (tile/block/warps/in flight); three launches / rank in ()")
    print(f"{'rows x width':>12} | {'three':>7} | " + " | ".join(f"{n:>18}" for n in names))
    for B, L in shapes:
        xs = [torch.randn(B, L, device=dev) for _ in range(a.calls)]
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        pt = page_table(B, L, dev)
        three = graph_ms([lambda x=x: tt.topk_triton(x, lens, K, page_table=pt, page_size=PAGE, rank=False)
                          for x in xs]) * 1e3
        cells = []
        for v in VARIANTS:
            outs = [torch.empty(B, K, dtype=torch.int32, device=dev) for _ in xs]
            t = graph_ms([lambda x=x, o=o: tt.run_rank(x, lens, o, pt, PAGE, **knobs(v)) for x, o in zip(xs, outs)]) * 1e3
            cells.append(f"{t:>8.2f} ({three / t:>5.2f}x)")
        print(f"{f'{B}x{L}':>12} | {three:>7.2f} | " + " | ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

"""DSA top-k's one-program-a-row kernel (`topk_triton._row_kernel`, rows up to ROW_MAX_WIDTH)
against the three launches (bracket, scan, finish), at decode shapes: k = 2,048, paged output.

Alone: each path as a CUDA graph of 8 calls (`cuda_timing.graph_ms`: PDL on, as in the decode
graph, no host work between calls), on random rows of length n in width L; the outputs compared
as sets. Step: the FP8 slice's decode step graph (`early_launch.step_graphs`, shipped switches)
under ROW_MAX_WIDTH on and off, interleaved over `--rounds`, with the logits' relative difference
(sparse MLA sums the same slots in another order).

    PYTHONPATH=. python3 benchmarks/topk_row.py [--parts alone,step] [--rounds 2] [--sizes 1 4] [--json out.json]
    (a GPU of compute capability 9.0+)
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from benchmarks import early_launch
from glm53.kernels import topk_triton as tt

K = 2048
# (rows, width, length): decode batches at 4K contexts in their own width (4,160) and in the
# serving graphs' next bucket (16K), and rows filling 8K and 16K widths
SHAPES = [(1, 4160, 4100), (1, 16384, 4100), (1, 8192, 8000), (1, 16384, 16000), (4, 4160, 4100),
          (4, 16384, 4100), (64, 4160, 4100), (64, 16384, 16000), (256, 4160, 4100)]


# the row kernel's settings timed alone: as shipped, then one knob changed
ROW_VARIANTS = {"row": {}, "row rb8": dict(rbits=8), "row w8": dict(num_warps=8), "row w32": dict(num_warps=32)}


def graph_us(fn, calls: int = 8) -> float:
    """µs a call of `fn`, from a CUDA graph of `calls` calls (`cuda_timing.graph_ms`)."""
    from glm53.support.cuda_timing import graph_ms

    return graph_ms([fn] * calls) * 1e3


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)


def time_alone(log, shapes=SHAPES, device: str = "cuda") -> list[dict]:
    """Each shape: the three launches, then the row kernel as shipped (`row_warps`, ROW_RBITS) and
    with 8-bit digits or other warps (`ROW_VARIANTS`), each against the three launches' sets."""
    dev, rows = torch.device(device), []
    for B, L, n in shapes:
        x = torch.randn(B, L, device=dev)
        lens = torch.full((B,), n, dtype=torch.int32, device=dev)
        pt = torch.randperm(B * -(-L // 64), device=dev, dtype=torch.int32).view(B, -1)
        three = tt.topk_triton(x, lens, K, pt, 64, row=False)
        us3 = graph_us(lambda: tt.topk_triton(x, lens, K, pt, 64, row=False))
        row = dict(B=B, L=L, n=n, three_us=us3)
        for name, knobs in ROW_VARIANTS.items():
            def one(knobs=knobs) -> torch.Tensor:
                out = torch.empty((B, K), dtype=torch.int32, device=dev)
                tt.run_row_topk(x, lens, out, pt, 64, **knobs)
                return out
            same = same_sets(one(), three)
            us = graph_us(one)
            row[name] = dict(us=us, same=same)
            log(f"B {B:3d} L {L:6d} n {n:6d}: three launches {us3:6.2f} us, {name:9s} {us:6.2f} us "
                f"({us / us3:.2f}x), same sets {same}")
        rows.append(row)
    return rows


def time_steps(base, sizes: list[int], rounds: int, context: int) -> list[dict]:
    """The step's graph with the three launches, then with rows up to 16K wide in one program
    (`early_launch.step_ab`, shipped switches)."""
    early_launch.switch("shipped")
    shipped = tt.ROW_MAX_WIDTH
    widest = partial(setattr, tt, "ROW_MAX_WIDTH")
    try:
        return early_launch.step_ab(base, sizes, rounds, context,
                                    {"three": partial(widest, 0), "row": partial(widest, 16384)})
    finally:
        tt.ROW_MAX_WIDTH = shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    early_launch.step_args(ap, [1, 4])
    ap.add_argument("--parts", default="alone,step", help="alone (the top-k by itself), step (the decode step)")
    a = ap.parse_args()

    def log(line: str) -> None:
        print(line, flush=True)

    log(torch.cuda.get_device_name())
    parts = a.parts.split(",")
    out = {"device": torch.cuda.get_device_name()}
    if "alone" in parts:
        out["alone"] = time_alone(log)
    if "step" in parts:
        out["steps"] = time_steps(early_launch.slice_runner(a.slice), a.sizes, a.rounds, a.context)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

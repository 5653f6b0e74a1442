"""Programmatic dependent launch (Hopper): how much it shortens a CUDA graph of small chained
Triton kernels, the shape of a decode step (issue 29's ITL at concurrency 1: ~130 launches a step).

Each of 128 kernels reads the previous one's output; with PDL it calls `gdc_wait()` first and is
launched with `launch_pdl=True` (optionally `gdc_launch_dependents()` before the wait, so the next
kernel's programs are scheduled as soon as every program of this one has started). Prints, per grid
size and per-program work, the replay time of the three chains and the time saved a boundary;
the chains' results are checked equal.

    python3 benchmarks/pdl_launch.py [--json out.json]     # a GPU of compute capability 9.0+
"""
import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents

from glm53.support.kernel_profile import replay_us


@triton.jit
def _step(x_ptr, y_ptr, n, ITERS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    v = tl.load(x_ptr + offs, mask=m, other=0.0)
    for _ in range(ITERS):
        v = v * 1.0000001 + 1e-7
    tl.store(y_ptr + offs, v + 1.0, mask=m)


def chain(bufs, n, grid, k, pdl, early, iters):
    for i in range(k):
        _step[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], n, ITERS=iters, PDL=pdl, EARLY=early, BLOCK=1024,
                       launch_pdl=pdl, num_warps=4)


def run(n, grid, k, pdl, early, iters, reps=200):
    bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    chain(bufs, n, grid, k, pdl, early, iters)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            chain(bufs, n, grid, k, pdl, early, iters)
    torch.cuda.synchronize()
    for b in bufs:
        b.zero_()
    g.replay()
    torch.cuda.synchronize()
    got = bufs[k % 2][:n].float().mean().item()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    return replay_us(g, reps), got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for grid in (1, 8, 132, 264):
        for iters in (0, 200):
            n = grid * 1024
            base, v0 = run(n, grid, 128, False, False, iters)
            pdl, v1 = run(n, grid, 128, True, False, iters)
            early, v2 = run(n, grid, 128, True, True, iters)
            r = dict(grid=grid, iters=iters, base_us=base, pdl_us=pdl, early_us=early, per_boundary_saved_us=(base - pdl) / 127,
                     per_boundary_saved_early_us=(base - early) / 127, ok=(abs(v0 - v1) < 1e-3 and abs(v0 - v2) < 1e-3), val=v0)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

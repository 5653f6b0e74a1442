"""MLA's absorbed query at decode sizes: the one-launch kernel (`kernels/absorb`: q_nope · W_UK per
head with q_pe rotated) against the torch path it replaces (`torch.bmm` + the rope kernel), on
GLM-5's per-GPU widths (64 heads at tp = 1; `--heads 8` for tp = 8).

Each figure is the GPU time of one call inside a CUDA graph that cycles through `--copies`
weight copies (more bytes than L2 holds, so the weights come from HBM as in a decode step),
with the weight bytes read per µs beside it.

    python3 benchmarks/absorb.py [--tokens 1 4 16] [--heads 64] [--copies 8]
"""

from __future__ import annotations

import argparse

import torch

from glm53.kernels.absorb import absorbed_query, absorbed_query_reference
from glm53.kernels.rope import rope_cos_sin, rope_inv_freq
from glm53.support.cuda_timing import graph_ms

NOPE, ROPE, R, V = 192, 64, 512, 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--copies", type=int, default=8)
    a = ap.parse_args()
    dev, dt, h = "cuda", torch.bfloat16, a.heads
    kv_b = [(torch.randn(h, NOPE + V, R, device=dev) * R ** -0.5).to(dt) for _ in range(a.copies)]
    nbytes = h * NOPE * R * 2
    print(f"{h} heads: W_UK {nbytes / 1e6:.1f} MB; {a.copies} copies cycled")
    print(f"{'tokens':>6} | {'fused µs':>9} | {'torch µs':>9} | {'torch/fused':>11} | fused GB/s")
    for n in a.tokens:
        q = torch.randn(n, h, NOPE + ROPE, device=dev).to(dt)
        cos, sin = rope_cos_sin(torch.randint(0, 200000, (n,), device=dev), rope_inv_freq(ROPE, 1e6, dev))
        f_ms = graph_ms([lambda w=w: absorbed_query(q, w[:, :NOPE], cos, sin, True) for w in kv_b])
        r_ms = graph_ms([lambda w=w: absorbed_query_reference(q, w[:, :NOPE], cos, sin, True) for w in kv_b])
        print(f"{n:>6} | {f_ms * 1e3:>9.2f} | {r_ms * 1e3:>9.2f} | {r_ms / f_ms:>10.2f}x | {nbytes / (f_ms * 1e6):.0f}")


if __name__ == "__main__":
    main()

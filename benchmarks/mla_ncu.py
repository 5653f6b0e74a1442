"""Run sparse_mla_triton at T=64 tokens, H=64 heads, 2048 slots a few times, for a profiler.

    python benchmarks/mla_ncu.py [--cfg block_n=32,num_stages=5,col_halves=false] [--reps 3]

`benchmarks/mla_ncu.sh` wraps it in `ncu --set full` and prints the top warp stall reasons.
"""

from __future__ import annotations

import argparse

import torch

from glm53.kernels.sparse_mla import sparse_mla_reference
from glm53.kernels.sparse_mla_triton import sparse_mla_triton


def parse_cfg(text: str) -> dict:
    """'kernel=tl,block_n=32,col_halves=false' -> kwargs of sparse_mla_triton (ints, 'true'/'false', strings)."""
    cfg = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        v = v.strip()
        cfg[k.strip()] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cfg = parse_cfg(args.cfg)
    T, H, K, R, P, page, ctx = args.tokens, args.heads, 2048, 512, 64, 64, 8192
    num_pages = T * ctx // page
    kv = torch.randn(num_pages, 2, page, R + P, device="cuda").bfloat16()[:, 1]  # strided pages
    q = torch.randn(T, H, R + P, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(num_pages * page, device="cuda")[:K] for _ in range(T)]).int()
    out = sparse_mla_triton(q, kv, idx, 1 / 24, R, **cfg)  # compiles outside the profiled launches
    ref = sparse_mla_reference(q[:2].float(), kv.float(), idx[:2], 1 / 24, R)
    print(f"cfg {cfg}: rel err {((out[:2].float() - ref).norm() / ref.norm()).item():.2e}", flush=True)
    for _ in range(args.reps):
        sparse_mla_triton(q, kv, idx, 1 / 24, R, **cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

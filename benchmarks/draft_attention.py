"""The DFlash draft's attention alone, per draft step (every draft layer): the paged kernel
(kernels/draft_attention_triton.py, a few schedules) against the formulation it replaced (every
layer's pages gathered once, then per layer the block appended with torch.cat and SDPA).

    PYTHONPATH=. python benchmarks/draft_attention.py [--sizes 1 64] [--blocks 4 16] [--ctx 3968]

Defaults are the slice draft's widths (48 query / 8 KV heads of 128, 2 layers, bf16, 64-token
pages). Every request sees its whole context; a width of one page more than it needs (as a graph's
width bucket has) is all hidden. Median of CUDA-event times over --iters calls after a warm-up."""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from glm53.kernels.draft_attention import draft_attention


def old_step(q, pool, table, kb, vb, mask):
    pages = pool[table]  # [R, W, 2·kv, L, ps, hd]: every layer, once per step
    r, w, h2, nl, ps, hd = pages.shape
    ctx = pages.permute(0, 1, 4, 2, 3, 5).reshape(r, w * ps, h2, nl, hd)
    for i in range(nl):
        k = torch.cat([ctx[..., 0::2, i, :], kb], dim=1).transpose(1, 2)
        v = torch.cat([ctx[..., 1::2, i, :], vb], dim=1).transpose(1, 2)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=hd**-0.5)


def new_step(q, pool, table, kb, vb, mask, **knobs):
    for i in range(pool.shape[2]):
        draft_attention(q, pool, i, table, kb, vb, mask, **knobs)


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 16])
    p.add_argument("--ctx", type=int, default=3968)
    p.add_argument("--kv", type=int, default=8)
    p.add_argument("--group", type=int, default=6)
    p.add_argument("--hd", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    width = -(-a.ctx // a.page) + 1
    variants = {"kernel": {}, "kernel, no skip": dict(skip_hidden=False), "kernel, 1 split": dict(num_splits=1),
                "kernel, 3 stages": dict(num_stages=3)}
    print(f"draft attention per step ({a.layers} layers, {a.kv}x{a.group} heads of {a.hd}, ctx {a.ctx}, "
          f"width {width} pages of {a.page}), ms:")
    for r in a.sizes:
        pool = torch.randn(r * width + 1, 2 * a.kv, a.layers, a.page, a.hd, device=dev, dtype=dt)
        table = torch.randperm(r * width + 1, device=dev)[: r * width].view(r, width)
        for b in a.blocks:
            q = torch.randn(r, a.kv, a.group * b, a.hd, device=dev, dtype=dt)
            kb, vb = (torch.randn(r, b, a.kv, a.hd, device=dev, dtype=dt) for _ in range(2))
            pos = torch.arange(width * a.page + b, device=dev)
            mask = ((pos < a.ctx) | (pos >= width * a.page))[None].expand(r, -1).contiguous()
            args = (q, pool, table, kb, vb, mask)
            row = {"old (gather + cat + SDPA)": timed(lambda: old_step(*args), a.iters)}
            for name, knobs in variants.items():
                row[name] = timed(lambda: new_step(*args, **knobs), a.iters)
            gbs = r * a.kv * a.ctx * a.hd * 2 * dt.itemsize * a.layers / row["kernel"] / 1e6  # context K/V read
            print(f"bs {r:3d} block {b:2d}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items())
                  + f" (kernel reads the context at {gbs:.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()

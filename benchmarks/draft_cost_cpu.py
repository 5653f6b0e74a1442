"""What drafting costs on the CPU (issue 31, item 7): a DFlash step at block 4 / 8 / 16 against a
plain decode step, and the draft-KV work (feature capture, projection, context K/V write) as a
share of a prompt's prefill, for the embedded pair, batch 1, one torch thread, CPU time of this
thread (medians; a shared CPU still moves them).

    PYTHONPATH=. python benchmarks/draft_cost_cpu.py [--draft DIR] [--prompt 200] [--iters 20]

Targets: a step at block 8 ≤ 2× a plain step; the draft-KV work ≤ 15 % of the prefill.
"""

from __future__ import annotations

import argparse
import time

import torch

from glm53.models import DraftBlock, ModelRunner, SeqChunk
from glm53.server.embedded_model import ensure_embedded_draft, ensure_embedded_model


def median_ms(f, n: int) -> float:
    f()  # warm-up
    ts = []
    for _ in range(n):
        t0 = time.thread_time()
        f()
        ts.append(time.thread_time() - t0)
    return sorted(ts)[n // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", help="default: the embedded DFlash draft")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = ensure_embedded_model()
    draft = a.draft or ensure_embedded_draft()
    plain = ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False)
    spec = ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False, draft_dir=draft)
    prompt = torch.randint(10, 4000, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    pages = list(range(-(-(a.prompt + 32) // 16)))
    tp = median_ms(lambda: plain.forward([SeqChunk(prompt, 0, pages)]), max(a.iters // 3, 3))
    ts = median_ms(lambda: spec.forward([SeqChunk(prompt, 0, pages)]), max(a.iters // 3, 3))
    print(f"prefill of {a.prompt} tokens: {tp:.1f} ms plain, {ts:.1f} ms with the draft KV "
          f"(+{(ts / tp - 1) * 100:.0f} %; target <= 15 %)")
    last = prompt[-1]
    dp = median_ms(lambda: plain.forward([SeqChunk([last], a.prompt, pages)]), a.iters)
    for b in (4, 8, 16):
        blk = [DraftBlock(last, a.prompt, pages, block_size=b)]
        ds = median_ms(lambda: spec.spec_step(blk), a.iters)
        dr = median_ms(lambda: spec.draft_block(blk), a.iters)
        print(f"block {b:2d}: step {ds:.1f} ms = {ds / dp:.2f}x the plain step's {dp:.1f} ms (drafting {dr:.1f} ms)"
              + ("; target <= 2x" if b == 8 else ""))


if __name__ == "__main__":
    main()

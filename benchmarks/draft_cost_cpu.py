"""What drafting costs on the CPU (issue 31, item 7): a DFlash step at block 4 / 8 / 16 against a
plain decode step, and the draft-KV work (feature capture, projection, context K/V write) as a
share of a prompt's prefill, for the embedded pair, batch 1, one torch thread, CPU time of this
thread.

Each ratio is the median over `--iters` rounds of the ratio within a round, where a round times
the two sides back to back (plain, then speculative): a shared CPU's speed drifts between rounds,
much less within one. The times quoted beside are the medians of each side.

    PYTHONPATH=. python benchmarks/draft_cost_cpu.py [--draft DIR] [--prompt 200] [--iters 30]

Targets: a step at block 8 ≤ 2× a plain step; the draft-KV work ≤ 15 % of the prefill.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from glm53.models import DraftBlock, ModelRunner, SeqChunk
from glm53.server.embedded_model import ensure_embedded_draft, ensure_embedded_model


def cpu_ms(f: Callable[[], object]) -> float:
    t0 = time.thread_time()
    f()
    return (time.thread_time() - t0) * 1e3


def paired(base: Callable[[], object], other: list[Callable[[], object]],
           n: int) -> tuple[float, list[float], list[float]]:
    """(median of base, medians of each of `other`, medians of each other / base within a round)."""
    for f in [base, *other]:
        f()  # warm-up
    tb, to = [], [[] for _ in other]
    for _ in range(n):
        tb.append(cpu_ms(base))
        for ts, f in zip(to, other):
            ts.append(cpu_ms(f))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return med(tb), [med(ts) for ts in to], [med([t / b for t, b in zip(ts, tb)]) for ts in to]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", help="default: the embedded DFlash draft")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = ensure_embedded_model()
    draft = a.draft or ensure_embedded_draft()
    plain = ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False)
    spec = ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False, draft_dir=draft)
    prompt = torch.randint(10, 4000, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    pages = list(range(-(-(a.prompt + 32) // 16)))
    tp, (ts,), (rs,) = paired(lambda: plain.forward([SeqChunk(prompt, 0, pages)]),
                              [lambda: spec.forward([SeqChunk(prompt, 0, pages)])], max(a.iters // 3, 5))
    print(f"prefill of {a.prompt} tokens: {tp:.1f} ms plain, {ts:.1f} ms with the draft KV "
          f"(+{(rs - 1) * 100:.0f} %; target <= 15 %)")
    last = prompt[-1]
    steps, drafts = [], []
    for b in (4, 8, 16):
        blk = [DraftBlock(last, a.prompt, pages, block_size=b)]
        steps.append(lambda blk=blk: spec.spec_step(blk))
        drafts.append(lambda blk=blk: spec.draft_block(blk))
    dp, times, ratios = paired(lambda: plain.forward([SeqChunk([last], a.prompt, pages)]), steps + drafts, a.iters)
    for i, b in enumerate((4, 8, 16)):
        print(f"block {b:2d}: step {times[i]:.1f} ms = {ratios[i]:.2f}x the plain step's {dp:.1f} ms "
              f"(drafting {times[3 + i]:.1f} ms)" + ("; target <= 2x" if b == 8 else ""))


if __name__ == "__main__":
    main()

"""What drafting costs on the CPU (issue 31, item 7): a DFlash step at block 4 / 8 / 16 against a
plain decode step, and the draft-KV work (feature capture, projection, context K/V write) as a
share of a prompt's prefill, for the embedded pair, batch 1, one torch thread, CPU time of this
thread.

Each ratio is the median over `--iters` rounds of the ratio within a round, where a round times
the two sides back to back (plain, then speculative): a shared CPU's speed drifts between rounds,
much less within one. The times quoted beside are the medians of each side.

    PYTHONPATH=. python benchmarks/draft_cost_cpu.py [--draft DIR] [--prompt 200] [--iters 30] [--split]

Targets: a step at block 8 ≤ 2× a plain step; the draft-KV work ≤ 15 % of the prefill.

`--split`: where each step's time goes, per block and for the plain step: this thread's CPU time
spent in each part (each part's own time, its timed sub-parts excluded), the median over `--iters`
rounds: the drafting forward (its fused layers, attention, context gather, logits), the draft
context write of the verify (projection, norm, K/V write), and in the target's forward the routed
experts, the indexer (its top-k apart), sparse MLA, the lm_head and the rest.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
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


# (module, attribute, label) of the parts `--split` times; a label names each part's own time.
SPLIT_PARTS = [
    ("glm53.models.draft", "DFlashDraft.draft_block", "drafting: rest (prep, embed, final norm, choose)"),
    ("glm53.models.draft", "DFlashDraft._layers_fused", "drafting: layers (products, norms, RoPE)"),
    ("glm53.models.draft", "draft_attention_gathered", "drafting: attention"),
    ("glm53.models.draft", "gather_context", "drafting: context gather"),
    ("glm53.models.draft", "DFlashDraft._logits_cpu", "drafting: logits"),
    ("glm53.models.draft", "DFlashDraft.write_context", "verify: draft context K/V write"),
    ("glm53.models.draft", "DFlashDraft.partial_projection", "verify: draft context projection"),
    ("glm53.models.draft", "DFlashDraft.context", "verify: draft context norm"),
    ("glm53.models.moe", "moe_experts", "target: routed experts"),
    ("glm53.models.model", "dsa_topk_paged", "target: indexer top-k"),
    ("glm53.models.model", "Indexer.forward", "target: indexer (rest)"),
    ("glm53.models.model", "sparse_mla", "target: sparse MLA"),
    ("glm53.models.model", "GlmForCausalLM.logits", "target: final norm + lm_head"),
    ("glm53.models.runner", "ModelRunner.forward", "target: rest of the forward"),
    ("glm53.models.runner", "ModelRunner.spec_step", "step: rest (verify batch, argmax read)"),
]


def timed_parts() -> tuple[dict[str, float], Callable[[], None]]:
    """Wraps the SPLIT_PARTS with this thread's CPU clock: (the dict each part's own seconds
    accumulate in, the undo)."""
    import importlib

    acc: dict[str, float] = defaultdict(float)
    stack: list[float] = []
    undo = []
    for mod_name, path, label in SPLIT_PARTS:
        owner = importlib.import_module(mod_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        raw = owner.__dict__[name]
        f = raw.__func__ if isinstance(raw, staticmethod) else raw

        def timed(*a, _f=f, _label=label, **k):
            t0 = time.thread_time()
            stack.append(0.0)
            try:
                return _f(*a, **k)
            finally:
                dt, inner = time.thread_time() - t0, stack.pop()
                acc[_label] += dt - inner
                if stack:
                    stack[-1] += dt

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        undo.append((owner, name, raw))
    return acc, lambda: [setattr(o, n, r) for o, n, r in reversed(undo)]


def split(named: dict[str, Callable[[], object]], n: int) -> None:
    """Prints each part's own CPU time per call of each of `named` (median over n rounds)."""
    acc, undo = timed_parts()
    per: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in named}
    total: dict[str, list[float]] = {k: [] for k in named}
    try:
        for f in named.values():
            f()
        for _ in range(n):
            for key, f in named.items():
                acc.clear()
                t0 = time.thread_time()
                f()
                total[key].append((time.thread_time() - t0) * 1e3)
                for _, _, label in SPLIT_PARTS:
                    per[key][label].append(acc.get(label, 0.0) * 1e3)
    finally:
        undo()
    med = statistics.median
    print(f"{'ms per call (own time, median of ' + str(n) + ')':<50}" + "".join(f"{k:>10}" for k in named))
    for _, _, label in SPLIT_PARTS:
        row = [med(per[k][label]) for k in named]
        if any(v >= 0.005 for v in row):
            print(f"{label:<50}" + "".join(f"{v:10.2f}" for v in row))
    print(f"{'total (timed by its own clock)':<50}" + "".join(f"{med(total[k]):10.2f}" for k in named))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", help="default: the embedded DFlash draft")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--split", action="store_true", help="also where each step's time goes (see the docstring)")
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
    if a.split:
        split({"plain": lambda: plain.forward([SeqChunk([last], a.prompt, pages)]),
               **{f"block {b}": f for b, f in zip((4, 8, 16), steps)}}, a.iters)


if __name__ == "__main__":
    main()

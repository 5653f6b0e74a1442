"""τ of sampled requests with sampled drafting vs argmax drafting (issue 31, item 4), through the
decode scheduler's real loop on one in-process CPU rank: the embedded target with a DFlash or
DSpark draft, prompts from the middle of a third-party package's source files (code the pair never
trained on), batch 1, one prompt after another, each request seeded.

    PYTHONPATH=. python benchmarks/sampled_drafting.py [--draft DIR ...] [--temperature 0.7]
        [--top-p 1.0] [--block 16] [--new 64] [--prompts 8] [--package httpx] [--seeds 2]

Sampled drafting: the draft samples each block position from its own q (temperature, top-k,
top-p, min-p as the request's; DSpark's Markov bias on the sampled predecessor) and verification
accepts with min(1, p/q). Argmax drafting: the draft proposes its argmax and verification accepts
it with probability p(d). Both are lossless; τ = tokens committed per verify step. Prints one
table; the ratio is sampled τ / argmax τ on the same prompts and seeds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from glm53.server.embedded_model import ensure_embedded_draft, ensure_embedded_model
from glm53.server.sampling import SamplingParams
from glm53.support.corpus import package_prompts
from glm53.support.decode_loop import decode_run, scheduler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", type=Path, nargs="+", help="default: the embedded DFlash draft")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--package", default="httpx")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    model = ensure_embedded_model()
    drafts = a.draft or [ensure_embedded_draft()]
    prompts = package_prompts(model, a.package, a.prompts, a.prompt_len)
    print(f"{len(prompts)} {a.package} prompts of {a.prompt_len} tokens, {a.new} new tokens, block {a.block}, "
          f"T={a.temperature}, top-p {a.top_p}, {a.seeds} seeds each, batch 1")
    print(f"{'draft':<28} | {'argmax τ':>8} | {'sampled τ':>9} | sampled / argmax")
    for d in drafts:
        taus = {}
        for sampled in (False, True):
            sched = scheduler(model, d, "cpu", a.block, max_running=1)
            sched.sampled_drafting = sampled
            toks = verify = 0
            try:
                for i, p in enumerate(prompts):
                    for s in range(a.seeds):
                        params = SamplingParams(temperature=a.temperature, top_p=a.top_p, seed=1000 * s + i)
                        _, t, v, _ = decode_run(sched, [p], a.new, params=params)
                        toks, verify = toks + t, verify + v
            finally:
                sched.close()
            taus[sampled] = toks / verify
        print(f"{d.name:<28} | {taus[False]:8.2f} | {taus[True]:9.2f} | {taus[True] / taus[False]:.2f}x", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f}s")

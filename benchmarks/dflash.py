"""DFlash on vs off: decode tokens/s and τ (mean tokens committed per verify step) of the decode
scheduler's real loop on one in-process rank, in one run.

    PYTHONPATH=. python benchmarks/dflash.py [--device cpu|cuda] [--batch 1 8] [--new 64]

Rows: plain decoding; DFlash with the given draft (default: a random draft written for the
embedded model, so τ ≈ 1 and the row shows the overhead); DFlash with *oracle* proposals (the
draft's output replaced by the true greedy continuation), which shows what a perfect draft buys
at this block size on this machine — an upper bound, not a claim about any trained draft.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from glm53.models import ModelRunner, PageAllocator, write_random_draft
from glm53.models.dspark import BlockChoice
from glm53.server.embedded_model import ensure_embedded_model
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.offline import greedy_generate
from glm53.support.decode_loop import decode_run, scheduler


def oracle(sched: DecodeScheduler, prompts: list[list[int]], want: list[list[int]]) -> None:
    """Replace the draft's proposals by the true greedy continuation."""
    truth = {len(p): w for p, w in zip(prompts, want)}

    def propose(blocks):
        rows = []
        for b in blocks:
            plen = max(n for n in truth if n <= b.start_pos)
            out = truth[plen]
            rows.append([out[j] if (j := b.start_pos + 1 + i - plen) < len(out) else 0
                         for i in range(b.block_size - 1)])
        tokens = torch.tensor(rows)
        return BlockChoice(tokens, torch.full((len(rows),), tokens.shape[1]))

    sched.workers.rank.runner.draft_block = propose


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--draft", help="a DFlash draft for the embedded model (default: a random one)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.device == "cpu":
        torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    model_dir = ensure_embedded_model(tmp / "cache")
    draft = Path(a.draft) if a.draft else write_random_draft(tmp / "draft", model_dir, seed=1, n_layers=2,
                                                           block_size=a.block)
    g = torch.Generator().manual_seed(0)
    print(f"device {a.device}, prompt {a.prompt} tokens, {a.new} new tokens, block {a.block}")
    print(f"{'batch':>5} | {'mode':<22} | {'tok/s':>8} | {'tau':>5} | speed-up vs off")
    for batch in a.batch:
        # Prompt lengths far enough apart that a block's position names its request (oracle()).
        prompts = [torch.randint(10, 4000, (a.prompt + (a.new + a.block) * i,), generator=g).tolist()
                   for i in range(batch)]
        ref = ModelRunner.from_dir(model_dir, page_size=16, num_pages=2048, device=a.device, dtype=torch.float32,
                                   progress=False)
        want = greedy_generate(ref, PageAllocator(2048), prompts, a.new, ignore_eos=True)
        del ref
        base = None
        for mode in ("off", "draft", "oracle proposals"):
            sched = scheduler(model_dir, None if mode == "off" else draft, a.device, a.block)
            try:
                if mode == "oracle proposals":
                    oracle(sched, prompts, want)
                decode_run(sched, prompts, 8)  # warm-up
                dt, toks, verify, outs = decode_run(sched, prompts, a.new)
            finally:
                sched.close()
            assert outs == want, f"{mode}: output differs from plain greedy"
            rate = toks / dt
            base = base or rate
            tau = f"{toks / verify:.2f}" if verify else "-"
            print(f"{batch:>5} | {mode:<22} | {rate:8.1f} | {tau:>5} | {rate / base:.2f}x")


if __name__ == "__main__":
    main()

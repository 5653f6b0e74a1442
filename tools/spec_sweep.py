"""Speculative decoding against plain greedy decoding on random targets and random drafts (CPU):

    PYTHONPATH=. python tools/spec_sweep.py [--seeds 40] [--first 7000] [--budget 1800]

Each seed draws a target (`tests.models.oracle_compare.random_config`, written by transformers)
and a draft fitting it (`test_spec_partial_accept.random_draft`: DFlash, or DSpark with a Markov
head, with or without its confidence head and cut; 1-3 layers, block 2-8, heads, KV heads, head
and MLP widths, which target layers it reads). Three prompts (one shorter than index_topk, two
several times longer) decode 20 new tokens, two at a time, through the decode scheduler's real
loop, twice: plain, then speculative with the draft's proposals replaced by the plain run's
continuation corrupted at random (`test_spec_partial_accept.sweep_case` and `_teach`: a random
draft is almost never accepted, this makes every accepted length occur). The outputs must be equal
token for token. The last line counts the failures; the exit status is 1 when any seed failed."""

from __future__ import annotations

import argparse
import time

import torch

from tests.models.test_spec_partial_accept import sweep_case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--first", type=int, default=7000)
    ap.add_argument("--budget", type=float, default=1800.0, help="seconds; seeds not reached are not counted")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0, ok, failed = time.time(), 0, []
    for seed in range(a.first, a.first + a.seeds):
        if time.time() - t0 > a.budget:
            break
        equal, cfg, shape, accepted, toks, verify = sweep_case(seed)
        ok += equal
        if not equal:
            failed.append(seed)
        print(f"seed {seed} {'ok' if equal else 'FAILED'} accepted {min(accepted, default=-1)}-{max(accepted, default=-1)} "
              f"tokens/verify {toks / max(verify, 1):.2f} draft {shape} target layers {cfg['num_hidden_layers']} "
              f"top-k {cfg['index_topk']}", flush=True)
    print(f"{ok} equal, {len(failed)} failed {failed}; {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

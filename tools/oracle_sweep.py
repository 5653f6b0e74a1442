"""Random tiny configs against transformers' GlmMoeDsaForCausalLM, on the CPU path:

    PYTHONPATH=. python tools/oracle_sweep.py [--seeds 200] [--first 5000] [--budget 1800]

Each seed draws a config, a page size and three prompt lengths (`tests.models.oracle_compare.
random_config`) and runs `test_against_transformers.sweep_case`, which the kept seeds' test runs
too: ours prefills the three prompts in one batch, then decodes 8 greedy tokens each;
the oracle's prefill logits must be within 1e-4 (relative) of ours and its argmax along our tokens
must be them. The oracle's `topk` breaks exact ties by lowest position, as ours does
(`stable_topk`). A mismatch on a seed whose index scores have a near-tie at the k-th place
(`IndexGapProbe` ratio <= 20: the comparison is ill-posed) is counted apart from a failure. The
last line counts them; the exit status is 1 when anything failed. Needs `transformers` (a test
dependency)."""

from __future__ import annotations

import argparse
import time

from tests.models.test_against_transformers import sweep_case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first", type=int, default=5000)
    ap.add_argument("--budget", type=float, default=1800.0, help="seconds; seeds not reached are not counted")
    a = ap.parse_args()
    t0, ok, ill, failed = time.time(), 0, 0, []
    for seed in range(a.first, a.first + a.seeds):
        if time.time() - t0 > a.budget:
            break
        agrees, err, probe, cfg, page = sweep_case(seed)
        gap = probe.min_ratio
        status = "ok" if agrees else "ill-posed" if gap <= 20 else "FAILED"
        ok += agrees
        ill += status == "ill-posed"
        if status == "FAILED":
            failed.append(seed)
        print(f"seed {seed} page {page:2d} {status:9s} max rel {err:.1e} index gap {gap:.1f}x  {cfg}", flush=True)
    print(f"{ok} agree, {ill} ill-posed (index near-tie), {len(failed)} failed {failed}; {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

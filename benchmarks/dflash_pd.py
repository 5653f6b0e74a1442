"""DFlash on vs off through the whole PD pipeline (router, prefill, UCX transfer, decode) on the
embedded trained pair: held-out Python prompts, greedy, one request at a time and all at once.

    PYTHONPATH=. python benchmarks/dflash_pd.py [--blocks 4 16] [--prompts 8] [--new 128] [--concurrent 16]
        [--device cpu|cuda]

`--device cuda`: both instances on GPU 0 (one-GPU PD, bf16, CUDA graphs as served; the transfer
moves pages within the GPU).

Prompts: the first 200 tokens of held-out standard-library files (tools/eval_dflash.py's, from
`glm53.support.corpus.held_file_prompts`). One at a time, each prompt runs twice, with
max_new_tokens 1 (prefill + transfer + first token) and N; the decode rate is
(N − 1) / (t_N − t_1), so it leaves out the prefill and transfer, which DFlash does not change.
The prefill instance runs without its prefix cache: with it, the second run of a prompt skips the
prefill the first one paid, t_N − t_1 loses that prefill's time and the rate can come out
negative (on the H200, where a prefill outweighs 128 decode steps of the tiny pair).
All at once: `--concurrent` requests together, output tokens / wall time. τ = tokens after the
first per verify step (the router's `spec_verify_ct`). Every DFlash output must equal the output
with DFlash off.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from glm53.support.corpus import held_file_prompts
from glm53.support.pd_bench import measure_deployment, table_header, table_row

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()
    ps = held_file_prompts(ASSETS / "tiny-glm5", max(a.prompts, a.concurrent), 200)
    cache = Path(tempfile.mkdtemp(prefix="dflash-pd-"))
    print(f"PD pipeline (1 prefill + 1 decode, {a.device}), {a.prompts} held-out prompts of 200 tokens one at a time, "
          f"{a.concurrent} at once, {a.new} new tokens, greedy")
    print(table_header("mode", a.concurrent))
    base = ref = None
    for block in [None, *a.blocks]:
        spec = None if block is None else {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash",
                                           "num_draft_tokens": block}
        run = measure_deployment(cache, spec, a.device, ps[: a.prompts], ps[: a.concurrent], a.new)
        base, ref = base or run, ref or run.outputs
        print(table_row("off" if block is None else f"dflash {block}", run, base, ref), flush=True)


if __name__ == "__main__":
    main()

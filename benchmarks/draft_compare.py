"""The three drafts of the embedded target compared through the whole PD pipeline (router, prefill,
transfer, decode): GLM-5's own MTP layer (NEXTN, shipped in assets/tiny-glm5), the DFlash draft
(assets/tiny-glm5-dflash) and the DSpark draft (assets/tiny-glm5-dspark), against no speculation,
greedy, on held-out third-party code.

    PYTHONPATH=. python benchmarks/draft_compare.py [--device cpu|cuda] [--package httpx] [--prompts 8]
        [--new 128] [--concurrent 16] [--width 4] [--modes off nextn dflash dspark]

Every draft verifies `--width` tokens per step (the bonus slot included): MTP chains width − 1
proposals (num_steps), DFlash and DSpark verify width-token blocks (num_draft_tokens,
dspark_block_size; no confidence cut). Prompts: `--prompt` tokens from the middle of the installed
package's source files (glm53.support.corpus.package_prompts: code none of the models trained on).
Batch 1: each prompt twice, max_new_tokens 1 and N, decode rate (N − 1) / (t_N − t_1) (prefill and
transfer left out; prefix cache off so both runs prefill). Batch `--concurrent`: that many requests
at once, output tokens / wall time. τ = tokens after the first per verify step (spec_verify_ct;
the MTP drafts nothing at a request's first decode step, which counts as a verify). Every
speculative output must equal the output with speculation off. `--device cuda`: both instances on
GPU 0 (bf16, CUDA graphs of the decode step, the DFlash step and the MTP step).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from glm53.support.corpus import package_prompts
from glm53.support.pd_bench import measure_deployment, table_header, table_row

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def spec_of(mode: str, width: int) -> dict | None:
    if mode == "off":
        return None
    if mode == "nextn":
        return {"algorithm": "NEXTN", "num_steps": width - 1}
    if mode == "dflash":
        return {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash", "num_draft_tokens": width}
    if mode == "dspark":
        return {"algorithm": "DSPARK", "draft_model_path": str(ASSETS / "tiny-glm5-dspark"), "dspark_block_size": width}
    raise ValueError(mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--package", default="httpx")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["off", "nextn", "dflash", "dspark"])
    a = ap.parse_args()
    if a.modes[0] != "off":
        raise SystemExit("--modes must start with off (the baseline every output is compared with)")
    ps = package_prompts(ASSETS / "tiny-glm5", a.package, max(a.prompts, a.concurrent), a.prompt)
    cache = Path(tempfile.mkdtemp(prefix="draft-compare-"))
    print(f"PD pipeline (1 prefill + 1 decode, {a.device}), {a.package} prompts of {a.prompt} tokens: {a.prompts} one "
          f"at a time, {a.concurrent} at once, {a.new} new tokens, greedy, verify width {a.width}")
    print(table_header("draft", a.concurrent))
    base = ref = None
    for mode in a.modes:
        run = measure_deployment(cache, spec_of(mode, a.width), a.device, ps[: a.prompts], ps[: a.concurrent], a.new)
        base, ref = base or run, ref or run.outputs
        print(table_row(mode, run, base, ref), flush=True)


if __name__ == "__main__":
    main()

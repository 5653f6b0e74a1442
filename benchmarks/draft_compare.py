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
GPU 0 (bf16, CUDA graphs where the draft has them; the MTP step runs eagerly).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from benchmarks.dflash_pd import generate, on_one_gpu
from glm53.support.cluster import Cluster
from glm53.support.corpus import package_prompts

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
    print(f"{'draft':<8} | {'batch 1 decode tok/s':>20} | {'tau':>5} | {'speed-up':>8} | "
          f"{f'batch {a.concurrent} tok/s':>15} | {'tau':>5} | {'speed-up':>8}")
    base1 = baseN = ref = None
    for mode in a.modes:
        c = Cluster(Path(tempfile.mkdtemp()), cache, speculative=spec_of(mode, a.width))
        c.cfg["defaults"]["disable_radix_cache"] = True
        c.config_path.write_text(yaml.safe_dump(c.cfg))
        if a.device == "cuda":
            on_one_gpu(c)
        c.start()
        http = httpx.Client()
        clients = [httpx.Client() for _ in range(a.concurrent)]  # made before the clock (dflash_pd.generate)
        try:
            generate(http, c.url, ps[0], 8)  # warm-up
            dec_t = toks = verify = 0.0
            outs = []
            for p in ps[: a.prompts]:
                t1, _ = generate(http, c.url, p, 1)
                tn, r = generate(http, c.url, p, a.new)
                dec_t += tn - t1
                toks += r["meta_info"]["completion_tokens"] - 1
                verify += r["meta_info"].get("spec_verify_ct", 0)
                outs.append(r["output_ids"])
            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.concurrent) as ex:
                res = list(ex.map(lambda hp: generate(hp[0], c.url, hp[1], a.new)[1], zip(clients, ps[: a.concurrent])))
            wall = time.perf_counter() - t0
        finally:
            for h in [http, *clients]:
                h.close()
            c.stop()
        tok_n = sum(r["meta_info"]["completion_tokens"] for r in res)
        ver_n = sum(r["meta_info"].get("spec_verify_ct", 0) for r in res)
        outs += [r["output_ids"] for r in res]
        ref = outs if ref is None else ref
        rate1, rateN = toks / dec_t, tok_n / wall
        base1, baseN = base1 or rate1, baseN or rateN
        tau1 = f"{toks / verify:.2f}" if verify else "-"
        tauN = f"{(tok_n - len(res)) / ver_n:.2f}" if ver_n else "-"
        print(f"{mode:<8} | {rate1:20.1f} | {tau1:>5} | {rate1 / base1:7.2f}x | {rateN:15.1f} | {tauN:>5} | "
              f"{rateN / baseN:7.2f}x" + ("" if outs == ref else "  OUTPUT DIFFERS FROM OFF"), flush=True)


if __name__ == "__main__":
    main()

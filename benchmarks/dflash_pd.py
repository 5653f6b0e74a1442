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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from glm53.support.cluster import Cluster
from glm53.support.corpus import held_file_prompts

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def generate(http: httpx.Client, url: str, ids: list[int], new: int) -> tuple[float, dict]:
    """One request on a client made before the clock starts (an httpx.Client() costs ~20-30 ms for
    its TLS context; made per request in 16 threads, that time landed in the measured window)."""
    t0 = time.perf_counter()
    r = http.post(f"{url}/generate", timeout=600, json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def on_one_gpu(c: Cluster) -> None:
    """Both instances on GPU 0 in bf16, each with its share of the memory."""
    c.cfg["defaults"].update(device="cuda", dtype="bfloat16", chunked_prefill_size=8192)
    for role in ("prefill", "decode"):
        c.cfg[role][0].update(devices=[0], mem_fraction_static=0.3)
    c.config_path.write_text(yaml.safe_dump(c.cfg))


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
    print(f"{'mode':<10} | {'1 at a time: decode tok/s':>26} | {'tau':>5} | {'speed-up':>8} | "
          f"{f'{a.concurrent} at once: tok/s':>20} | {'tau':>5} | {'speed-up':>8}")
    base1 = baseN = ref = None
    for block in [None, *a.blocks]:
        spec = None if block is None else {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash",
                                           "num_draft_tokens": block}
        c = Cluster(Path(tempfile.mkdtemp()), cache, speculative=spec)
        c.cfg["defaults"]["disable_radix_cache"] = True  # every run of a prompt prefills it (docstring)
        c.config_path.write_text(yaml.safe_dump(c.cfg))
        if a.device == "cuda":
            on_one_gpu(c)
        c.start()
        try:
            clients = [httpx.Client() for _ in range(a.concurrent)]
            http = clients[0]
            generate(http, c.url, ps[0], 8)  # warm-up
            dec_t = toks = verify = 0.0
            outs = []
            for p in ps[: a.prompts]:
                t1, _ = generate(http, c.url, p, 1)
                tn, r = generate(http, c.url, p, a.new)
                dec_t += tn - t1
                toks += r["meta_info"]["completion_tokens"] - 1
                verify += r["meta_info"].get("spec_verify_ct", 0)
                outs.append(r["output_ids"] if "output_ids" in r else r["text"])
            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.concurrent) as ex:
                res = list(ex.map(lambda hp: generate(hp[0], c.url, hp[1], a.new)[1], zip(clients, ps[: a.concurrent])))
            wall = time.perf_counter() - t0
        finally:
            c.stop()
        tok_n = sum(r["meta_info"]["completion_tokens"] for r in res)
        ver_n = sum(r["meta_info"].get("spec_verify_ct", 0) for r in res)
        outs += [r["output_ids"] if "output_ids" in r else r["text"] for r in res]
        ref = outs if ref is None else ref
        rate1, rateN = toks / dec_t, tok_n / wall
        base1, baseN = base1 or rate1, baseN or rateN
        tau1 = f"{toks / verify:.2f}" if verify else "-"
        tauN = f"{(tok_n - len(res)) / ver_n:.2f}" if ver_n else "-"
        name = "off" if block is None else f"dflash {block}"
        print(f"{name:<10} | {rate1:26.1f} | {tau1:>5} | {rate1 / base1:7.2f}x | {rateN:20.1f} | {tauN:>5} | "
              f"{rateN / baseN:7.2f}x" + ("" if outs == ref else "  OUTPUT DIFFERS FROM OFF"), flush=True)


if __name__ == "__main__":
    main()

"""Decode tiles of the block-FP8 products and MoE with the weight tile as the MMA's left operand
(SWAP, the dispatcher's default at decode sizes since 2026-12-05) against the same tiles unswapped,
with a sweep of the swapped tiles' widths, pipeline stages and K splits, beside the FP8 HBM floor.

Dense: the FP8 slice's five one-GPU products and GLM-5's tp = 8 served products
(`benchmarks/fp8_gemm.py`'s tables) at M rows quantized as served (two e4m3 terms at these sizes);
MoE: the slice's and GLM-5's tp = 8 expert stacks with the shared expert as one more
(`benchmarks/moe_fp8_layer.py`), w8a8 at N tokens. Every variant is checked against the
unswapped default before it is timed (CUDA-graph replays over rotating weight copies or routing
draws); per M, the dense sums over a table.

    PYTHONPATH=. python3 benchmarks/fp8_swap.py [--m 1,2,4,8,16] [--n 1,2,4,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import torch
import triton

from benchmarks.fp8_gemm import GLM5_TP8_SERVED, SLICE_TP1_SERVED, Shape
from benchmarks.moe_fp8_layer import draws, rel, stacks, timer
from glm53.kernels.dispatch import sm_count
from glm53.kernels.fp8_act import two_terms
from glm53.kernels.fp8_gemm_triton import GemmConfig, default_config, fp8_gemm_w8a8_quantized
from glm53.kernels.fp8_quant import quantize_fp8_terms_triton
from glm53.kernels.moe_fp8_triton import default_fp8_config, moe_experts_fp8_triton
from glm53.kernels.moe_triton import MoEConfig
from glm53.support.hbm_floor import copy_bandwidth

MOE_SETS = {"slice": dict(E=16, H=6144, I=2048, k=8), "glm5": dict(E=256, H=6144, I=256, k=8)}


ms = timer(cuda=True)  # each variant's calls in turn in one CUDA graph, as moe_fp8_layer times them


def dense(ms_list: list[int], bw: float, log) -> list[dict]:
    rows, sums = [], {}
    for tname, table in (("slice", SLICE_TP1_SERVED), ("glm5", GLM5_TP8_SERVED)):
        for name, (N, K) in table.items():
            sh = Shape(name, N, K, "cuda", False)
            for m in ms_list:
                x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
                lo = two_terms(m)
                q, s, xl = quantize_fp8_terms_triton(x, lo, 128)

                def f(cfg, i, q=q, s=s, xl=xl, sh=sh):
                    return fp8_gemm_w8a8_quantized(q, s, sh.q[i], sh.s[i], torch.bfloat16, cfg, lo=xl)

                rule = default_config(m, N, K, True, torch.device("cuda"), lo=lo)
                plain = dataclasses.replace(rule, SWAP=False)
                ref = f(plain, 0).float()
                row = dict(table=tname, shape=name, N=N, K=K, M=m, rule=str(rule), floor_ms=sh.fp8_bytes(m) / bw * 1e3,
                           unswapped_ms=ms([lambda i=i: f(plain, i) for i in range(len(sh.q))]),
                           rule_ms=ms([lambda i=i: f(rule, i) for i in range(len(sh.q))]), rule_err=rel(f(rule, 0), ref))
                bt = max(16, triton.next_power_of_2(m * (2 if lo else 1)))
                best = None
                for bn, st, sk in itertools.product((64, 128), (3, 4, 6), (1, 2, 3, 4, 6, 8)):
                    if sk > triton.cdiv(K, 128):
                        continue
                    cfg = GemmConfig(BM=bt, BN=bn, BK=128, SPLIT_K=sk, num_warps=4, num_stages=st, SWAP=True)
                    err = rel(f(cfg, 0), ref)
                    assert err < 1e-2, (name, m, cfg, err)
                    t = ms([lambda i=i: f(cfg, i) for i in range(len(sh.q))])
                    if best is None or t < best[0]:
                        best = (t, bn, st, sk)
                row["best_swept"] = best
                rows.append(row)
                acc = sums.setdefault((tname, m), [0.0, 0.0, 0.0, 0.0])
                for j, v in enumerate((row["unswapped_ms"], row["rule_ms"], best[0], row["floor_ms"])):
                    acc[j] += v
                log(f"dense {tname:5} {name:>14} M={m:<3} unswapped {row['unswapped_ms'] * 1e3:6.1f} us  rule "
                    f"{row['rule_ms'] * 1e3:6.1f} us (split {rule.SPLIT_K}, err {row['rule_err']:.1e})  best swept "
                    f"{best[0] * 1e3:6.1f} us (BN {best[1]}, {best[2]} stages, split {best[3]})  floor {row['floor_ms'] * 1e3:5.1f} us")
            del sh
            torch.cuda.empty_cache()
    for (tname, m), (u, r, b, fl) in sums.items():
        rows.append(dict(table=tname, M=m, sum=True, unswapped_ms=u, rule_ms=r, best_ms=b, floor_ms=fl))
        log(f"sum {tname} M={m}: unswapped {u * 1e3:.1f} us, rule {r * 1e3:.1f} us (x{u / r:.2f}, {fl / r:.0%} of the "
            f"{fl * 1e3:.1f} us floor), best swept {b * 1e3:.1f} us")
    return rows


def moe(ns: list[int], bw: float, log) -> list[dict]:
    rows = []
    sms = sm_count(torch.device("cuda"))
    for sname, c in MOE_SETS.items():
        st = stacks(c, "cuda")
        E, H, I = c["E"], c["H"], c["I"]
        per_expert = 3 * I * H + (st[1][0].numel() * 2 + st[5][0].numel()) * 4
        for N in ns:
            sets = draws(N, c, "cuda", 8)

            def f(s, cfg, st=st):
                return moe_experts_fp8_triton(s[0], s[3], s[4], *st, variant="w8a8", config=cfg)

            rule = default_fp8_config(N * (c["k"] + 1), E + 1, "w8a8", I, H, sms, lo=two_terms(N))
            plain = dataclasses.replace(rule, SWAP=False)
            ref = f(sets[0], plain).float()
            hit = sum(int(torch.unique(s[4]).numel()) for s in sets) / len(sets)
            row = dict(set=sname, N=N, rule=str(rule), floor_ms=(hit * per_expert + 2 * N * H * 2) / bw * 1e3,
                       unswapped_ms=ms([lambda s=s: f(s, plain) for s in sets]),
                       rule_ms=ms([lambda s=s: f(s, rule) for s in sets]), rule_err=rel(f(sets[0], rule), ref))
            sweep = []
            for bn2, stg, sk in itertools.product((64, 128), (2, 3, 4), (1, 2, 4)):
                cfg = MoEConfig(BM=16, BN1=128, BN2=bn2, BK=128, num_warps=4, num_stages=stg, SPLIT_K=sk, SWAP=True)
                err = rel(f(sets[0], cfg), ref)
                assert err < 2e-2, (sname, N, cfg, err)
                sweep.append((ms([lambda s=s: f(s, cfg) for s in sets]), bn2, stg, sk))
            row["sweep"] = sweep
            best = min(sweep)
            rows.append(row)
            log(f"moe {sname:5} N={N:<3} unswapped {row['unswapped_ms'] * 1e3:6.1f} us  rule {row['rule_ms'] * 1e3:6.1f} us "
                f"(split {rule.SPLIT_K}, {rule.num_stages} stages, err {row['rule_err']:.1e}; x{row['unswapped_ms'] / row['rule_ms']:.2f}, "
                f"{row['floor_ms'] / row['rule_ms']:.0%} of the {row['floor_ms'] * 1e3:.1f} us floor)  best swept {best[0] * 1e3:6.1f} us "
                f"(BN2 {best[1]}, {best[2]} stages, split {best[3]})")
        del st
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8,16", help="dense rows")
    ap.add_argument("--n", default="1,2,4,8", help="MoE tokens")
    ap.add_argument("--only", default="dense,moe")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t0 = time.time()

    def log(s: str) -> None:
        print(f"[{time.time() - t0:6.1f}] {s}", flush=True)

    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    report = {"bandwidth": bw}
    if "dense" in a.only:
        report["dense"] = dense([int(m) for m in a.m.split(",")], bw, log)
    if "moe" in a.only:
        report["moe"] = moe([int(n) for n in a.n.split(",")], bw, log)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)


if __name__ == "__main__":
    main()

"""The decode GEMM's one-row tiles (`fp8_gemm_triton.default_config`; `DEEP_ONE_ROW`: 6 stages,
even K splits and 8 warps from 16 K blocks on, against the rule before it) on the FP8 slice.

Products: the slice's batch-1 block-FP8 products are recorded from one eager decode step (their
N, K, two activation terms or one, whether a norm takes the split sum), then each is timed alone
under both rules, cold L2 (a graph of calls over weight copies at other addresses), against the
time its weight takes to read at the measured copy rate; `--grid` adds 48 configs a shape (BN
64 / 128, 4 / 6 stages, 4 / 8 warps, split 1-8) and prints the best of each. Step: the whole
decode step's graph replayed under both rules, interleaved over `--rounds` (the relative
difference of the logits is printed: the splits change the sums' order).

    PYTHONPATH=. python3 benchmarks/decode_tiles.py [--sizes 1 4 16] [--rounds 2] [--grid] [--json out.json]
    (a GPU of compute capability 9.0+)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from functools import partial

import torch

from benchmarks import early_launch
from benchmarks.fp8_gemm import Timer, n_sets, rel
from glm53.kernels import fp8_gemm_triton as G

RULES = {"deep": True, "before": False}  # name -> DEEP_ONE_ROW


def record_products(runner) -> dict[tuple, int]:
    """(M, N, K, two terms, parts kept) -> launches, over one eager batch-1 decode step."""
    from glm53.models import SeqChunk

    seen: dict[tuple, int] = {}
    plain = G.fp8_gemm_w8a8_quantized

    def spy(q, s, w, w_scale, out_dtype, config=None, lo=None, keep_parts=False):
        key = (q.shape[0], w.shape[0], w.shape[1], lo is not None, keep_parts)
        seen[key] = seen.get(key, 0) + 1
        return plain(q, s, w, w_scale, out_dtype, config, lo=lo, keep_parts=keep_parts)

    runner.forward([SeqChunk([1, 2, 3], 0, [0])])  # the prefill's products are not recorded
    G.fp8_gemm_w8a8_quantized = spy
    try:
        runner.forward([SeqChunk([5], 3, [0])])
    finally:
        G.fp8_gemm_w8a8_quantized = plain
    return seen


def time_products(seen: dict[tuple, int], grid: bool, bw: float, log) -> list[dict]:
    from glm53.kernels.fp8_quant import quantize_fp8_blocks, quantize_fp8_terms_triton

    timer, dev, rows = Timer(True, reps=20), torch.device("cuda"), []
    for (M, N, K, lo, keep), count in sorted(seen.items(), key=lambda kv: -kv[0][1] * kv[0][2]):
        wq, ws = quantize_fp8_blocks(torch.randn(N, K, device=dev) * K**-0.5)
        sets = n_sets(N * K, False)
        wqs, wss = [wq] + [wq.clone() for _ in range(sets - 1)], [ws] + [ws.clone() for _ in range(sets - 1)]
        q, s, x_lo = quantize_fp8_terms_triton(torch.randn(M, K, device=dev, dtype=torch.bfloat16), lo)

        def run(cfg, i=0):
            return G.fp8_gemm_w8a8_quantized(q, s, wqs[i], wss[i], torch.bfloat16, cfg, lo=x_lo, keep_parts=keep)

        def us(cfg) -> float:
            return timer.ms([lambda i=i: run(cfg, i) for i in range(sets)]) * 1e3

        ref = G.fp8_gemm_w8a8_quantized(q, s, wq, ws, torch.bfloat16, lo=x_lo).float()
        row = dict(M=M, N=N, K=K, two_terms=lo, count=count, read_floor_us=N * K / bw * 1e6)
        for name, deep in RULES.items():
            G.DEEP_ONE_ROW = deep
            cfg = G.default_config(M, N, K, True, dev, lo=lo)
            out = G.fp8_gemm_w8a8_quantized(q, s, wq, ws, torch.bfloat16, cfg, lo=x_lo)
            row[name] = dict(us=us(cfg), config=dataclasses.asdict(cfg), rel=rel(out, ref))
        G.DEEP_ONE_ROW = True
        if grid:
            base = G.default_config(M, N, K, True, dev, lo=lo)
            res = []
            for bn, st, nw, sp in itertools.product((64, 128), (4, 6), (4, 8), (1, 2, 3, 4, 6, 8)):
                cfg = dataclasses.replace(base, BN=bn, num_stages=st, num_warps=nw, SPLIT_K=sp)
                res.append((us(cfg), dict(BN=bn, stages=st, warps=nw, split=sp)))
            row["grid_best"] = [dict(us=t, **c) for t, c in sorted(res, key=lambda r: r[0])[:4]]
        rows.append(row)
        d, b = row["deep"], row["before"]
        log(f"M {M} N {N:6d} K {K:6d} x{count}: before {b['us']:6.1f} us, deep {d['us']:6.1f} us "
            f"({d['config']['num_stages']} stages, {d['config']['num_warps']} warps, split {d['config']['SPLIT_K']}), "
            f"read floor {row['read_floor_us']:.1f} us; rel {d['rel']:.1e}"
            + (f"; grid best {row['grid_best'][0]['us']:.1f} us {row['grid_best'][0]}" if grid else ""))
    for name in RULES:
        log(f"batch-1 products summed once a step, {name}: {sum(r['count'] * r[name]['us'] for r in rows):.1f} us")
    return rows


def time_steps(base, sizes: list[int], rounds: int, context: int) -> list[dict]:
    """The step's graph under both rules (`early_launch.step_ab`, shipped switches; "before" first)."""
    early_launch.switch("shipped")
    try:
        settings = {name: partial(setattr, G, "DEEP_ONE_ROW", RULES[name]) for name in ("before", "deep")}
        return early_launch.step_ab(base, sizes, rounds, context, settings)
    finally:
        G.DEEP_ONE_ROW = True


def main() -> None:
    from glm53.support.hbm_floor import copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    early_launch.step_args(ap, [1, 4, 16])
    ap.add_argument("--grid", action="store_true", help="time 48 configs a product shape too")
    a = ap.parse_args()

    def log(line: str) -> None:
        print(line, flush=True)

    log(torch.cuda.get_device_name())
    bw = copy_bandwidth()
    log(f"copy rate {bw / 1e12:.2f} TB/s (read + write)")
    base = early_launch.slice_runner(a.slice)
    products = time_products(record_products(base), a.grid, bw, log)
    steps = time_steps(base, a.sizes, a.rounds, a.context)
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_rate": bw,
                                      "products": products, "steps": steps}, indent=1))


if __name__ == "__main__":
    main()

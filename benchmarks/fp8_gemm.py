"""Block-FP8 GEMM and MoE benchmark (issue 29): the Triton kernels of `glm53/kernels/fp8_*` and
`moe_fp8*` beside torch's bf16 matmul (cuBLAS) and the bf16 fused MoE, at GLM-5's tp = 8
per-rank shapes, every figure and ratio measured in one run on one GPU.

Sections, in order (the tables are printed again at the end):

1. decode: both decode candidates, w8a16 (FP8 weights dequantized in the kernel) and w8a8 (x
   quantized per 1×128 group, one more launch, then FP8 × FP8; at these sizes with the second
   e4m3 term, `fp8_act.two_terms`, and beside it "w8a8_1" with one term), at M = 1..64 for every shape; per
   M the sum over the shapes (one layer's linears); the crossover M and the `W8A16_MAX_M` it
   implies, which this run then sets for the dispatcher (`--w8a16-max-m` overrides it); bf16
   cuBLAS and the FP8 HBM floor beside them;
2. gemm: M = 1, 64, 4096: bf16 `x @ w.T` (cuBLAS), w8a16, w8a8 (quantization included; at
   M >= 1024 also the GEMM alone on pre-quantized x), the dispatched variant's TFLOP/s and its
   speedup over bf16, and at M <= 64 the HBM floor (FP8 weight + scale + x + y bytes over the
   copy bandwidth measured here); the target is speedup >= 1.5 at M = 4096. `--table layers`:
   one product per checkpoint linear; `served`: the products the model runs (`models/fused`: the
   linears that share an input stacked, one quantization each), bf16 on the same stacked shapes;
3. chain (`--only chain`): each served product with the kernel that produces its input, at
   M = 4096 (`--chain-m`): bf16 = the producer (RMSNorm, the residual add + RMSNorm in one
   kernel, or SwiGLU's silu(g)·u) + the bf16
   matmul; FP8 "separate" = the same producer + the FP8 product quantizing its input (before
   `fp8_act`); FP8 "fused" = the producer writing the quantized rows itself (`fp8_act`) + the
   product on them, as the served model runs it. Ratios with and without the producer's plain
   time (the norm or SwiGLU bf16 runs too); o_proj's input comes from the attention (no producer);
4. moe: GLM-5's routed experts per rank (E 256, H 6144, I 2048 / 8 = 256, top-8) at decode sizes
   N = 1..64 (and 4096): FP8 w8a16 (up to `MOE_GEMV_MAX_TOKENS` tokens the per-pair GEMVs,
   `moe_fp8_gemv_triton`, with the tile kernels' w8a16 beside them as "tiles"), w8a8 (two terms
   where the rule gives them) and w8a8_1 (one term), the bf16 fused kernel, and the HBM floor (bytes of
   the experts the batch hits, fp8 + scales, + x + out, over the copy bandwidth); the MoE
   crossover (`MOE_W8A16_MAX_TOKENS`); `--moe-table slice`: the FP8 slice's experts (16 of 2048);
5. moe_gemv (`--only moe_gemv`): the per-pair GEMVs' rule (`moe_gemv_config`) and a sweep of their
   configs (rows a program, H slices, down rows) beside w8a8 at each `--moe-n`.

Every row is checked against the dequantized fp32 reference before it is timed (relative
error printed). Timing: CUDA events around CUDA-graph replays (launch gaps amortised), each graph
running the op over several weight copies in turn (>= 4x the 60 MB L2 in total) so a replay does
not read a warm L2; the MoE rotates its routing (random ids per set) over 1.2 GB of experts.

    python benchmarks/fp8_gemm.py [--m 1,64,4096] [--decode-m 1,2,4,8,16,32,64] [--moe-n 1,2,4,8,16,32,64,4096]
                                  [--only decode,gemm,moe,sweep,moe_gemv] [--sweep] [--w8a16-max-m N] [--json out.json]
                                  [--table layers,served] [--moe-table glm5|slice]
    TRITON_INTERPRET=1 python benchmarks/fp8_gemm.py --smoke   # tiny shapes on CPU: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import triton

from glm53.kernels import fp8_gemm as gemm_mod
from glm53.kernels import moe_fp8 as moe_mod
from glm53.kernels.dispatch import sm_count, triton_interpreting
from glm53.kernels.fp8_act import add_rms_norm_fp8, rms_norm_fp8, silu_mul_fp8
from glm53.kernels.norm import add_rms_norm, rms_norm
from glm53.kernels import fp8_gemm_cublas as fp8_gemm_cublas_mod
from glm53.kernels.fp8_gemm_cublas import fp8_gemm_cublas
from glm53.kernels.fp8_gemm_triton import GemmConfig, fp8_gemm_w8a8, fp8_gemm_w8a16
from glm53.kernels.fp8_quant import dequantize_fp8_blocks, quantize_fp8_blocks, quantize_fp8_groups_triton
from glm53.kernels.moe_fp8_triton import default_fp8_config, moe_experts_fp8_triton
from glm53.kernels.moe_triton import MoEConfig, moe_experts_triton
from glm53.support.cuda_timing import graph_ms

L2_BYTES = 60 << 20
# GLM-5 per-rank linears at tp = 8, (N, K) of W [N, K]: hidden 6144, q_lora 2048, kv_lora 512 +
# rope 64, 64 heads (qk 192 + 64, v 256) -> 8 a rank, indexer 32 x 128 (replicated), dense
# intermediate 12288 / 8, one shared expert 2048 / 8 (tests/kernels/fp8_cases.py has the same table)
GLM5_TP8 = {
    "q_a_proj": (2048, 6144),
    "kv_a_proj_with_mqa": (576, 6144),
    "q_b_proj": (2048, 2048),
    "kv_b_proj": (3584, 512),
    "o_proj": (6144, 2048),
    "indexer.wq_b": (4096, 2048),
    "indexer.wk": (128, 6144),
    "dense gate_up": (3072, 6144),
    "dense down": (6144, 1536),
    "shared gate_up": (512, 6144),
    "shared down": (6144, 256),
}
# The same layer's FP8 products as the served model runs them (models/fused): the linears that
# share an input stacked into one weight (each member's rows padded to whole 128-row blocks:
# kv_a's 576 -> 640), one activation quantization each; kv_b_proj is no GEMM there (the absorbed
# attention reads it dequantized), nor is the shared expert's: it runs as the routed experts' last
# expert in their fused kernel (`moe.Experts.absorb_`; benchmarks/moe_fp8_layer.py times that
# layer against bf16). bf16 runs the same stacked shapes (a bf16 model fuses too).
GLM5_TP8_SERVED = {
    "q_a+kv_a+wk": (2048 + 640 + 128, 6144),
    "q_b+wq_b": (2048 + 4096, 2048),
    "o_proj": (6144, 2048),
    "dense gate_up": (3072, 6144),
    "dense down": (6144, 1536),
}
# The FP8 slice's served products on one GPU (tp = 1: tools/make_slice.py's GLM-5 widths, 64 heads,
# the dense MLP of layer 0), what its decode ITL reads
SLICE_TP1_SERVED = {
    "q_a+kv_a+wk": (2048 + 640 + 128, 6144),
    "q_b+wq_b": (64 * 256 + 32 * 128, 2048),
    "o_proj": (6144, 64 * 256),
    "dense gate_up": (2 * 12288, 6144),
    "dense down": (6144, 12288),
}
TABLES = {"layers": GLM5_TP8, "served": GLM5_TP8_SERVED, "slice": SLICE_TP1_SERVED}
# What produces each served product's input (`chain`): "norm" an RMSNorm over K, "addnorm" the
# residual add and the norm in one kernel (the post-attention norm; dense: the output is also read
# as is: the indexer's gates on full layers, the router and routed experts in a MoE layer), "silu"
# SwiGLU over the gate_up halves, None the attention output (quantized by the product).
GLM5_TP8_PRODUCERS = {
    "q_a+kv_a+wk": ("norm", True),
    "q_b+wq_b": ("norm", False),
    "o_proj": (None, False),
    "dense gate_up": ("addnorm", False),
    "dense down": ("silu", False),
}
MOE = dict(E=256, H=6144, I=256, k=8)
MOE_SLICE = dict(E=16, H=6144, I=2048, k=8)  # the FP8 slice's routed experts (tools/make_slice.py, tp = 1)
SMOKE_SHAPES = {"tiny_576": (576, 256), "tiny_ragged": (200, 136)}
SMOKE_MOE = dict(E=6, H=136, I=96, k=2)
ROWS: list[dict] = []
SWEEP_DECODE = [GemmConfig(16, bn, 128, SPLIT_K=sk, num_warps=4, num_stages=4) for bn in (32, 64, 128) for sk in (1, 2, 4, 8)] + \
    [GemmConfig(16, bn, 128, SPLIT_K=sk, num_warps=w, num_stages=st) for bn, w, st in ((64, 4, 6), (128, 4, 6), (128, 8, 4))
     for sk in (1, 2, 4)]
# (none of these spills registers on sm_90 with Triton 3.9: 128x256 and 128-row MoE tiles did, so they are out)
SWEEP_PREFILL = [GemmConfig(128, 128, 128, num_warps=8, num_stages=3), GemmConfig(128, 128, 128, num_warps=8, num_stages=4),
                 GemmConfig(128, 128, 128, GROUP_M=16, num_warps=8, num_stages=4), GemmConfig(64, 128, 128, num_warps=4, num_stages=3),
                 GemmConfig(128, 64, 128, num_warps=4, num_stages=3), GemmConfig(128, 128, 64, num_warps=8, num_stages=4)]


class Timer:
    """Median ms per call of a list of calls (one per input set). CUDA: a graph that runs the
    calls in turn (at least `min_calls` of them), replayed `reps` times between events. CPU
    (--smoke): one wall-clock pass."""

    def __init__(self, cuda: bool, reps: int = 20, min_calls: int = 16):
        self.cuda, self.reps, self.min_calls = cuda, reps, min_calls

    def ms(self, fns) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t0) * 1e3 / len(fns)
        # the calls in turn, at least min_calls of them
        return graph_ms([fns[i % len(fns)] for i in range(max(self.min_calls, len(fns)))], self.reps, warm_replays=1)


def copy_bandwidth(dev: str) -> float:
    if dev == "cuda":
        from glm53.support.hbm_floor import copy_bandwidth as cb

        return cb()
    a = torch.empty(1 << 24, dtype=torch.uint8)
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    b.copy_(a)
    return 2 * a.numel() / (time.perf_counter() - t0)


def n_sets(bytes_per_set: int, smoke: bool, cap: int = 128) -> int:
    return 1 if smoke else max(2, min(cap, math.ceil(4 * L2_BYTES / max(1, bytes_per_set))))


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


class Shape:
    """Weight copies of one (N, K) in FP8 (+ scales) and bf16, and the fp32 reference of set 0."""

    def __init__(self, name: str, N: int, K: int, dev: str, smoke: bool):
        self.name, self.N, self.K = name, N, K
        q, s = quantize_fp8_blocks(torch.randn(N, K, device=dev) * K**-0.5)
        sets = n_sets(N * K * 2, smoke)  # sized by the bf16 copy (the larger)
        # copies: the same values at other addresses (a replay never finds them in L2)
        self.q = [q] + [q.clone() for _ in range(sets - 1)]
        self.s = [s] + [s.clone() for _ in range(sets - 1)]
        wb = dequantize_fp8_blocks(q, s)
        self.w32 = wb
        self.wb = [wb.to(torch.bfloat16)] + [wb.to(torch.bfloat16) for _ in range(sets - 1)]

    def fp8_bytes(self, M: int) -> int:
        nb, kb = -(-self.N // 128), -(-self.K // 128)
        return self.N * self.K + nb * kb * 4 + M * self.K * 2 + M * self.N * 2


def _variant_fn(variant: str, config=None):
    if variant == "cublas":
        return lambda x, q, s: fp8_gemm_cublas(x, q, s)
    if variant == "w8a8_1":  # one activation term whatever the size
        return lambda x, q, s: fp8_gemm_w8a8(x, q, s, config=config, lo=False)
    f = {"w8a16": fp8_gemm_w8a16, "w8a8": fp8_gemm_w8a8}[variant]
    return lambda x, q, s: f(x, q, s, config=config)


def time_variant(sh: Shape, x: torch.Tensor, variant: str, timer: Timer, config=None) -> float:
    f = _variant_fn(variant, config)
    return timer.ms([lambda i=i: f(x, sh.q[i], sh.s[i]) for i in range(len(sh.q))])


def check_variant(sh: Shape, x: torch.Tensor, variant: str, config=None) -> float:
    return rel(_variant_fn(variant, config)(x, sh.q[0], sh.s[0]), x.float() @ sh.w32.t())


def bench_decode(shapes: list[Shape], ms: list[int], timer: Timer, dev: str, bw: float, log) -> int:
    """Both decode variants at every M, with bf16 cuBLAS and the FP8 HBM floor beside them;
    returns the W8A16_MAX_M the sums imply."""
    sums = {m: {"w8a16": 0.0, "w8a8": 0.0, "w8a8_1": 0.0, "bf16": 0.0, "floor": 0.0} for m in ms}
    for sh in shapes:
        for m in ms:
            x = torch.randn(m, sh.K, device=dev).to(torch.bfloat16)
            row = dict(section="decode", shape=sh.name, N=sh.N, K=sh.K, M=m, floor_ms=sh.fp8_bytes(m) / bw * 1e3)
            row["bf16_ms"] = timer.ms([lambda i=i: x @ sh.wb[i].t() for i in range(len(sh.wb))])
            sums[m]["bf16"] += row["bf16_ms"]
            sums[m]["floor"] += row["floor_ms"]
            for v in ("w8a16", "w8a8", "w8a8_1"):
                row[f"{v}_err"] = check_variant(sh, x, v)
                row[f"{v}_ms"] = t = time_variant(sh, x, v, timer)
                sums[m][v] += t
            ROWS.append(row)
            log(f"decode {sh.name:>20} M={m:<3} w8a16 {row['w8a16_ms'] * 1e3:8.1f} us (err {row['w8a16_err']:.1e})  "
                f"w8a8 {row['w8a8_ms'] * 1e3:8.1f} us (err {row['w8a8_err']:.1e})  "
                f"one term {row['w8a8_1_ms'] * 1e3:8.1f} us (err {row['w8a8_1_err']:.1e})  bf16 {row['bf16_ms'] * 1e3:7.1f} us  "
                f"floor {row['floor_ms'] * 1e3:5.1f} us")
    limit = 0
    for m in ms:  # the largest M below which w8a16 never loses (summed over the shapes)
        if sums[m]["w8a16"] > sums[m]["w8a8"]:
            break
        limit = m
    cross = next((m for m in ms if sums[m]["w8a8"] < sums[m]["w8a16"]), None)
    ROWS.append(dict(section="decode_sum", sums=sums, crossover_m=cross, w8a16_max_m=limit))
    return limit


def bench_gemm(shapes: list[Shape], ms: list[int], timer: Timer, dev: str, bw: float, log, table: str = "layers") -> None:
    for m in ms:
        tot = {"bf16": 0.0, "fp8": 0.0, "flops": 0.0}
        for sh in shapes:
            x = torch.randn(m, sh.K, device=dev).to(torch.bfloat16)
            flops = 2 * m * sh.N * sh.K
            variant = gemm_mod.fp8_variant(m, sh.N, sh.K, torch.device(dev))
            row = dict(section="gemm", table=table, shape=sh.name, N=sh.N, K=sh.K, M=m, variant=variant)
            row["bf16_ms"] = timer.ms([lambda i=i: x @ sh.wb[i].t() for i in range(len(sh.wb))])
            cublas = fp8_gemm_cublas_mod.supports(sh.N, sh.K) and fp8_gemm_cublas_mod.available(0)
            for v in ("w8a16", "w8a8", "cublas"):
                if v == "cublas" and not cublas:
                    continue
                row[f"{v}_err"] = check_variant(sh, x, v)
                row[f"{v}_ms"] = time_variant(sh, x, v, timer)
            if m >= 1024:  # the GEMM alone: x quantized outside the timed region
                xq = quantize_fp8_groups_triton(x)
                row["w8a8_gemm_only_ms"] = timer.ms([lambda i=i: fp8_gemm_w8a8(x, sh.q[i], sh.s[i], x_fp8=xq)
                                                     for i in range(len(sh.q))])
                if cublas:
                    qs = fp8_gemm_cublas_mod.quantize_rows(x)
                    row["cublas_gemm_only_ms"] = timer.ms([
                        lambda i=i: fp8_gemm_cublas_mod.scaled_mm(qs.q, qs.scale, sh.q[i], sh.s[i], torch.bfloat16)
                        for i in range(len(sh.q))])
                    row["cublas_gemm_only_speedup"] = row["bf16_ms"] / row["cublas_gemm_only_ms"]
            fp8 = row[f"{row['variant']}_ms"]
            row["fp8_tflops"] = flops / (fp8 * 1e-3) / 1e12
            row["bf16_tflops"] = flops / (row["bf16_ms"] * 1e-3) / 1e12
            row["speedup"] = row["bf16_ms"] / fp8
            row["floor_ms"] = sh.fp8_bytes(m) / bw * 1e3
            tot["bf16"] += row["bf16_ms"]
            tot["fp8"] += fp8
            tot["flops"] += flops
            ROWS.append(row)
            extra = (f"  cublas {row['cublas_ms'] * 1e3:9.1f}" if "cublas_ms" in row else "") + \
                (f" (GEMM alone x{row['cublas_gemm_only_speedup']:.2f} bf16)" if "cublas_gemm_only_ms" in row else "")
            log(f"gemm {sh.name:>20} M={m:<5} bf16 {row['bf16_ms'] * 1e3:9.1f} us  w8a16 {row['w8a16_ms'] * 1e3:9.1f}  "
                f"w8a8 {row['w8a8_ms'] * 1e3:9.1f}{extra}  -> {row['variant']} {row['fp8_tflops']:7.1f} TFLOP/s "
                f"(bf16 {row['bf16_tflops']:6.1f}), x{row['speedup']:.2f}")
        ROWS.append(dict(section="gemm_sum", table=table, M=m, bf16_ms=tot["bf16"], fp8_ms=tot["fp8"],
                         speedup=tot["bf16"] / tot["fp8"], fp8_tflops=tot["flops"] / (tot["fp8"] * 1e-3) / 1e12,
                         bf16_tflops=tot["flops"] / (tot["bf16"] * 1e-3) / 1e12))


def bench_chain(shapes: list[Shape], ms: list[int], timer: Timer, dev: str, log, producers: dict) -> None:
    """Each product with its input's producer (module docstring, section 3)."""
    for m in ms:
        tot = {"bf16": 0.0, "separate": 0.0, "fused": 0.0, "producer": 0.0}
        for sh in shapes:
            kind, dense = producers[sh.name]
            h = torch.randn(m, sh.K, device=dev).to(torch.bfloat16)
            norm_w = (torch.rand(sh.K, device=dev) + 0.5).to(torch.bfloat16)
            gu = torch.randn(m, 2 * sh.K, device=dev).to(torch.bfloat16)
            g, u = gu[:, : sh.K], gu[:, sh.K :]
            if kind == "norm":
                plain = lambda: rms_norm(h, norm_w, 1e-6)  # noqa: E731
                quantized = lambda: rms_norm_fp8(h, norm_w, 1e-6, dense=dense)[1]  # noqa: E731
            elif kind == "addnorm":
                res = torch.randn_like(h)
                plain = lambda: add_rms_norm(h, res, norm_w, 1e-6)[1]  # noqa: E731
                quantized = lambda: add_rms_norm_fp8(h, res, norm_w, 1e-6, dense=dense)[2]  # noqa: E731
            elif kind == "silu":
                plain = lambda: torch.nn.functional.silu(g) * u  # noqa: E731
                quantized = lambda: silu_mul_fp8(g, u)  # noqa: E731
            else:
                plain = quantized = lambda: h  # noqa: E731
            row = dict(section="chain", shape=sh.name, N=sh.N, K=sh.K, M=m, producer=kind or "-", dense=dense)
            # the reference: the dequantized product of the fused path's own input
            ref = plain().float() @ sh.w32.t()
            if kind is None:
                row["fused_err"] = rel(gemm_mod.fp8_gemm(h, sh.q[0], sh.s[0]), ref)
            else:
                row["fused_err"] = rel(gemm_mod.fp8_gemm_rows(quantized(), sh.q[0], sh.s[0], torch.bfloat16), ref)
            row["producer_ms"] = timer.ms([plain]) if kind else 0.0
            row["bf16_ms"] = timer.ms([lambda i=i: plain() @ sh.wb[i].t() for i in range(len(sh.wb))])
            row["separate_ms"] = timer.ms([lambda i=i: gemm_mod.fp8_gemm(plain(), sh.q[i], sh.s[i])
                                           for i in range(len(sh.q))])
            if kind is None:
                row["fused_ms"] = row["separate_ms"]
            else:
                row["fused_ms"] = timer.ms([lambda i=i: gemm_mod.fp8_gemm_rows(quantized(), sh.q[i], sh.s[i], torch.bfloat16)
                                            for i in range(len(sh.q))])
            for k in tot:
                tot[k] += row[f"{k}_ms"]
            ROWS.append(row)
            p = row["producer_ms"]
            log(f"chain {sh.name:>16} M={m:<5} producer {row['producer']:>4} {p * 1e3:6.1f} us  bf16 {row['bf16_ms'] * 1e3:7.1f}  "
                f"FP8 separate {row['separate_ms'] * 1e3:7.1f}  fused {row['fused_ms'] * 1e3:7.1f} (err {row['fused_err']:.1e})  "
                f"x{row['bf16_ms'] / row['fused_ms']:.2f} with the producer, "
                f"x{(row['bf16_ms'] - p) / (row['fused_ms'] - p):.2f} without")
        p = tot["producer"]
        ROWS.append(dict(section="chain_sum", M=m, **{f"{k}_ms": v for k, v in tot.items()},
                         speedup=tot["bf16"] / tot["fused"], speedup_products=(tot["bf16"] - p) / (tot["fused"] - p),
                         speedup_separate=(tot["bf16"] - p) / (tot["separate"] - p)))


def _moe_sets(N: int, cfg: dict, dev: str, sets: int):
    E, k = cfg["E"], cfg["k"]
    out = []
    for _ in range(sets):
        ids = torch.rand(N, E, device=dev).argsort(dim=1)[:, :k]
        out.append((torch.randn(N, cfg["H"], device=dev).to(torch.bfloat16), torch.rand(N, k, device=dev) + 0.05, ids))
    return out


def moe_weights(cfg: dict, dev: str):
    """(fp8 experts as moe_experts_fp8 takes them: fused gate_up, None, None, down; their bf16
    dequantized copies gate_up [E, 2I, H] and down)."""
    E, H, I = cfg["E"], cfg["H"], cfg["I"]
    g, gs = quantize_fp8_blocks(torch.randn(E, 2 * I, H, device=dev) * H**-0.5)  # fused gate_up
    d, ds = quantize_fp8_blocks(torch.randn(E, H, I, device=dev) * I**-0.5)
    return (g, gs, None, None, d, ds), dequantize_fp8_blocks(g, gs, dtype=torch.bfloat16), \
        dequantize_fp8_blocks(d, ds, dtype=torch.bfloat16)


def bench_moe(ns: list[int], weights, cfg: dict, timer: Timer, dev: str, bw: float, smoke: bool, log) -> int:
    H, I = cfg["H"], cfg["I"]
    fp8, gb, db = weights
    g, gs, _, _, d, ds = fp8
    per_expert = 3 * I * H + (gs[0].numel() + ds[0].numel()) * 4
    limit, lost = 0, False
    for N in ns:
        sets = _moe_sets(N, cfg, dev, 1 if smoke else 8)
        x, w, ids = sets[0]
        ref = moe_mod.moe_experts_fp8_reference(x.float(), w, ids, *fp8)
        row = dict(section="moe", N=N, **cfg)
        tile = default_fp8_config(N * ids.shape[1], g.shape[0], "w8a16", I, H, sm_count(x.device))
        for v, lo in (("w8a16", None), ("w8a16_tile", None), ("w8a8", None), ("w8a8_1", False)):
            # w8a16_tile: the tile kernels where w8a16 runs the per-pair GEMVs (a few tokens)
            kv = dict(variant={"w8a8_1": "w8a8", "w8a16_tile": "w8a16"}.get(v, v), lo=lo,
                      config=tile if v == "w8a16_tile" else None)
            row[f"{v}_err"] = rel(moe_experts_fp8_triton(x, w, ids, *fp8, **kv), ref)
            row[f"{v}_ms"] = timer.ms([lambda s=s, kv=kv: moe_experts_fp8_triton(*s, *fp8, **kv) for s in sets])
        row["bf16_ms"] = timer.ms([lambda s=s: moe_experts_triton(*s, gb[:, :I], gb[:, I:], db) for s in sets])
        hit = statistics.mean(int(torch.unique(s[2]).numel()) for s in sets)
        row["experts_hit"] = hit
        row["floor_ms"] = (hit * per_expert + N * H * 2 * 2) / bw * 1e3
        row["bf16_floor_ms"] = (hit * 3 * I * H * 2 + N * H * 2 * 2) / bw * 1e3
        best = min(row["w8a16_ms"], row["w8a8_ms"])
        row["floor_share"] = row["floor_ms"] / best
        # MOE_W8A16_MAX_TOKENS is the tile kernels' crossover (the GEMVs have their own rule)
        if not lost and row["w8a16_tile_ms"] <= row["w8a8_ms"]:
            limit = N
        else:
            lost = True
        ROWS.append(row)
        log(f"moe N={N:<5} hit {hit:6.1f}  w8a16 {row['w8a16_ms'] * 1e3:9.1f} us (err {row['w8a16_err']:.1e})  "
            f"tiles {row['w8a16_tile_ms'] * 1e3:9.1f} us  "
            f"w8a8 {row['w8a8_ms'] * 1e3:9.1f} us (err {row['w8a8_err']:.1e})  "
            f"one term {row['w8a8_1_ms'] * 1e3:9.1f} us (err {row['w8a8_1_err']:.1e})  bf16 {row['bf16_ms'] * 1e3:9.1f} us  "
            f"floor {row['floor_ms'] * 1e3:8.1f} us ({row['floor_share']:.0%} of it)")
    return limit


def sweep(shapes: list[Shape], timer: Timer, dev: str, smoke: bool, log, ms=(1, 64, 4096)) -> None:
    """Every sweep config on three shapes of the layers table (a wide and a narrow one, kv_a's
    partial block; another table: all its shapes) at M = 1 and 64 (decode tiles, both modes) and
    4096 (prefill configs, w8a8), those of `ms`."""
    picks = [s for s in shapes if s.name in ("q_a_proj", "o_proj", "kv_a_proj_with_mqa")] or shapes
    plan = [(1, SWEEP_DECODE, ("w8a16", "w8a8")),
            (64, [GemmConfig(64, c.BN, c.BK, SPLIT_K=c.SPLIT_K, num_warps=4, num_stages=4) for c in SWEEP_DECODE],
             ("w8a16", "w8a8")),
            (4096, SWEEP_PREFILL, ("w8a8",))]
    plan = [p for p in plan if p[0] in ms]
    if smoke:  # the code path only
        plan = [(1, SWEEP_DECODE[:2], ("w8a16", "w8a8")),
                (3, SWEEP_PREFILL[:1], ("w8a8",))]
    for sh in picks:
        for m, cfgs, variants in plan:
            x = torch.randn(m, sh.K, device=dev).to(torch.bfloat16)
            for v in variants:
                res = []
                for c in cfgs:
                    try:
                        e = check_variant(sh, x, v, c)
                        t = time_variant(sh, x, v, timer, c) if e < 2e-2 or v == "w8a8" and e < 6e-2 else float("nan")
                    except Exception as ex:  # e.g. out of shared memory: report, go on
                        e, t = float("nan"), float("nan")
                        log(f"    {c}: {type(ex).__name__}: {str(ex)[:80]}")
                    res.append((t, c, e))
                best = min((r for r in res if r[0] == r[0]), default=None, key=lambda r: r[0])
                ROWS.append(dict(section="sweep", shape=sh.name, M=m, variant=v,
                                 results=[dict(config=c.__dict__, ms=t, err=e) for t, c, e in res]))
                if best:
                    log(f"sweep {sh.name:>20} M={m:<5} {v}: best {best[0] * 1e3:.1f} us with {best[1]}")


def moe_sweep(weights, cfg: dict, timer: Timer, dev: str, smoke: bool, log) -> None:
    """MoE tiles at decode sizes (N = 1 and 64: <= 2 rows per expert) and at N = 4096."""
    fp8 = weights[0]
    dec = [MoEConfig(16, bn1, bn2, 128, num_warps=4, num_stages=4) for bn1 in (32, 64, 128) for bn2 in (64, 128)]
    pre = [MoEConfig(64, 128, 128, 128, num_warps=8, num_stages=3), MoEConfig(64, 128, 128, 128, num_warps=8, num_stages=4),
           MoEConfig(64, 128, 128, 64, num_warps=8, num_stages=4), MoEConfig(32, 128, 128, 128, num_warps=8, num_stages=4)]
    plan = [(1, dec), (64, dec), (4096, pre)] if not smoke else [(2, [dec[0], dec[-1]])]
    for N, cfgs in plan:
        sets = _moe_sets(N, cfg, dev, 1 if smoke else 8)
        x, w, ids = sets[0]
        ref = moe_mod.moe_experts_fp8_reference(x.float(), w, ids, *fp8)
        for v in ("w8a16", "w8a8"):
            res = []
            for c in cfgs:
                if v == "w8a8" and c.BN1 != 128:
                    continue
                try:
                    e = rel(moe_experts_fp8_triton(x, w, ids, *fp8, variant=v, config=c), ref)
                    t = timer.ms([lambda s=s: moe_experts_fp8_triton(*s, *fp8, variant=v, config=c) for s in sets])
                except Exception as ex:  # e.g. out of shared memory: report, go on
                    e, t = float("nan"), float("nan")
                    log(f"    {c}: {type(ex).__name__}: {str(ex)[:80]}")
                res.append((t, c, e))
            best = min((r for r in res if r[0] == r[0]), default=None, key=lambda r: r[0])
            ROWS.append(dict(section="moe_sweep", N=N, variant=v,
                             results=[dict(config=c.__dict__, ms=t, err=e) for t, c, e in res]))
            if best:
                log(f"moe sweep N={N:<5} {v}: best {best[0] * 1e3:.1f} us (err {best[2]:.1e}) with {best[1]}")


def moe_gemv_sweep(ns: list[int], weights, cfg: dict, timer: Timer, dev: str, smoke: bool, log) -> None:
    """The per-pair GEMVs (w8a16 at a few tokens): gate+up rows a program, H slices, down rows,
    beside the dispatched w8a8 tiles in the same run."""
    from glm53.kernels.moe_fp8_gemv_triton import MoEGemvConfig, moe_gemv_config

    fp8 = weights[0]
    grid = [MoEGemvConfig(BN1=bn1, BN2=bn2, SPLIT=sp) for bn1 in (8, 16, 32) for sp in (1, 2, 4, 8, 16)
            for bn2 in (64, 128)]
    if smoke:
        grid = [MoEGemvConfig(BN1=16, BN2=32, BK=64, num_warps=1, num_stages=1, SPLIT=sp) for sp in (1, 2)]
        ns = ns[:1]
    for N in ns:
        sets = _moe_sets(N, cfg, dev, 1 if smoke else 8)
        x, w, ids = sets[0]
        ref = moe_mod.moe_experts_fp8_reference(x.float(), w, ids, *fp8)
        w8a8 = timer.ms([lambda s=s: moe_experts_fp8_triton(*s, *fp8, variant="w8a8") for s in sets])
        rule = moe_gemv_config(N * cfg["k"], cfg["I"], cfg["H"], sm_count(x.device))
        res = []
        for c in [rule] + grid:
            e = rel(moe_experts_fp8_triton(x, w, ids, *fp8, variant="w8a16", config=c), ref)
            t = timer.ms([lambda s=s: moe_experts_fp8_triton(*s, *fp8, variant="w8a16", config=c) for s in sets])
            res.append((t, c, e))
        best = min(res, key=lambda r: r[0])
        ROWS.append(dict(section="moe_gemv_sweep", N=N, w8a8_ms=w8a8, rule_ms=res[0][0], rule=rule.__dict__,
                         results=[dict(config=c.__dict__, ms=t, err=e) for t, c, e in res]))
        log(f"moe gemv N={N:<3} w8a8 {w8a8 * 1e3:.1f} us  rule {res[0][0] * 1e3:.1f} us ({rule})  "
            f"best {best[0] * 1e3:.1f} us (err {best[2]:.1e}) with {best[1]}")


def print_tables(bw: float) -> None:
    dec = [r for r in ROWS if r["section"] == "decode_sum"]
    if dec:
        d = dec[0]
        print("\n| M | w8a16 us (sum of shapes) | w8a8 us | w8a8 one term us | w8a8 / w8a16 | "
              "bf16 cuBLAS us | FP8 floor us | floor / best FP8 |\n|---|---|---|---|---|---|---|---|")
        for m, s in d["sums"].items():
            print(f"| {m} | {s['w8a16'] * 1e3:.1f} | {s['w8a8'] * 1e3:.1f} | {s['w8a8_1'] * 1e3:.1f} | "
                  f"{s['w8a8'] / s['w8a16']:.2f} | "
                  f"{s['bf16'] * 1e3:.1f} | {s['floor'] * 1e3:.1f} | {s['floor'] / min(s['w8a16'], s['w8a8']):.0%} |")
        print(f"decode crossover: w8a8 first faster at M = {d['crossover_m']}; W8A16_MAX_M = {d['w8a16_max_m']}")
    g = [r for r in ROWS if r["section"] == "gemm"]
    if g:
        print("\n| table | shape | N | K | M | bf16 us | w8a16 us | w8a8 us | cuBLAS us (GEMM alone) | variant | FP8 TFLOP/s | "
              "bf16 TFLOP/s | speedup | floor us | err |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in g:
            err = r[f"{r['variant']}_err"]
            cub = (f"{r['cublas_ms'] * 1e3:.1f}" if "cublas_ms" in r else "-") + \
                (f" ({r['cublas_gemm_only_ms'] * 1e3:.1f})" if "cublas_gemm_only_ms" in r else "")
            print(f"| {r['table']} | {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['bf16_ms'] * 1e3:.1f} | "
                  f"{r['w8a16_ms'] * 1e3:.1f} | {r['w8a8_ms'] * 1e3:.1f} | {cub} | {r['variant']} | {r['fp8_tflops']:.1f} | "
                  f"{r['bf16_tflops']:.1f} | {r['speedup']:.2f} | {r['floor_ms'] * 1e3:.1f} | {err:.1e} |")
        for r in (r for r in ROWS if r["section"] == "gemm_sum"):
            print(f"all shapes ({r['table']}), M={r['M']}: FP8 {r['fp8_tflops']:.1f} TFLOP/s, bf16 {r['bf16_tflops']:.1f}, "
                  f"speedup x{r['speedup']:.2f}")
    c = [r for r in ROWS if r["section"] == "chain"]
    if c:
        print("\n| product (N, K) | M | producer | producer us | bf16 us | FP8 separate us | FP8 fused us | "
              "fused / bf16 with producer | without | err |\n|---|---|---|---|---|---|---|---|---|---|")
        for r in c:
            p = r["producer_ms"]
            print(f"| {r['shape']} ({r['N']}, {r['K']}) | {r['M']} | {r['producer']}{' +dense' if r['dense'] else ''} | "
                  f"{p * 1e3:.1f} | {r['bf16_ms'] * 1e3:.1f} | {r['separate_ms'] * 1e3:.1f} | {r['fused_ms'] * 1e3:.1f} | "
                  f"{r['bf16_ms'] / r['fused_ms']:.2f} | {(r['bf16_ms'] - p) / (r['fused_ms'] - p):.2f} | {r['fused_err']:.1e} |")
        for r in (r for r in ROWS if r["section"] == "chain_sum"):
            print(f"chain, M={r['M']}: bf16 {r['bf16_ms'] * 1e3:.1f} us, FP8 separate {r['separate_ms'] * 1e3:.1f}, fused "
                  f"{r['fused_ms'] * 1e3:.1f}; producers {r['producer_ms'] * 1e3:.1f}. Speed-up over bf16 with the producers "
                  f"x{r['speedup']:.2f}; products alone (producers' plain time taken out) x{r['speedup_products']:.2f} "
                  f"(separate quantization: x{r['speedup_separate']:.2f})")
    m = [r for r in ROWS if r["section"] == "moe"]
    if m:
        print("\n| N | experts hit | w8a16 us | w8a16 tiles us | w8a8 us | w8a8 one term us | bf16 us | FP8 floor us | "
              "floor / best FP8 | bf16 floor us | err w8a16 | err w8a8 |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in m:
            print(f"| {r['N']} | {r['experts_hit']:.1f} | {r['w8a16_ms'] * 1e3:.1f} | {r['w8a16_tile_ms'] * 1e3:.1f} | "
                  f"{r['w8a8_ms'] * 1e3:.1f} | "
                  f"{r['w8a8_1_ms'] * 1e3:.1f} | "
                  f"{r['bf16_ms'] * 1e3:.1f} | {r['floor_ms'] * 1e3:.1f} | {r['floor_share']:.0%} | "
                  f"{r['bf16_floor_ms'] * 1e3:.1f} | {r['w8a16_err']:.1e} | {r['w8a8_err']:.1e} |")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; dispatcher: W8A16_MAX_M = {gemm_mod.W8A16_MAX_M}, "
          f"MOE_W8A16_MAX_TOKENS = {moe_mod.MOE_W8A16_MAX_TOKENS}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,64,4096")
    ap.add_argument("--decode-m", default="1,2,4,8,16,32,64")
    ap.add_argument("--moe-n", default="1,2,4,8,16,32,64,4096")
    ap.add_argument("--only", default="decode,gemm,moe", help="sections among decode,gemm,chain,moe,sweep,moe_gemv")
    ap.add_argument("--chain-m", default="4096")
    ap.add_argument("--sweep", action="store_true", help="add the tile sweeps (GEMM: three shapes; MoE) at the end")
    ap.add_argument("--w8a16-max-m", type=int, default=None, help="dispatcher threshold (default: the measured one)")
    ap.add_argument("--table", default="layers",
                    help="gemm shapes: layers (one per checkpoint linear), served (as the model fuses them), or both")
    ap.add_argument("--decode-table", default="layers", help="decode and sweep shapes: layers, served or slice")
    ap.add_argument("--sweep-m", default="1,64,4096", help="the sweep's row counts, among 1, 64 and 4096")
    ap.add_argument("--moe-table", default="glm5", choices=("glm5", "slice"),
                    help="the MoE sections' experts: GLM-5's at tp = 8 or the FP8 slice's at tp = 1")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one rep, on CPU under TRITON_INTERPRET=1")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.smoke:
        if not triton_interpreting():
            sys.exit("--smoke runs the Triton kernels on CPU: start it with TRITON_INTERPRET=1")
        dev, table = "cpu", SMOKE_SHAPES
        a.m, a.decode_m, a.moe_n = "1,3", "1,2", "1,2"
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA device (or --smoke with TRITON_INTERPRET=1)")
        dev, table = "cuda", TABLES[a.decode_table]
    only = set(a.only.split(",")) | ({"sweep"} if a.sweep else set())
    timer = Timer(dev == "cuda")
    bw = copy_bandwidth(dev)
    env = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)", torch=torch.__version__,
               triton=triton.__version__, copy_TBps=bw / 1e12)

    def log(s: str) -> None:
        print(s, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(env=env, rows=ROWS), f, indent=1, default=str)

    log(f"{env['device']}: copy {bw / 1e12:.3f} TB/s, torch {torch.__version__}, triton {triton.__version__}")
    shapes = [Shape(n, N, K, dev, a.smoke) for n, (N, K) in table.items()] if only & {"decode", "gemm", "sweep", "chain"} else []
    if "decode" in only:
        measured = bench_decode(shapes, [int(m) for m in a.decode_m.split(",")], timer, dev, bw, log)
        log(f"decode: w8a16 no slower than w8a8 up to M = {measured} (summed over the shapes)")
        gemm_mod.W8A16_MAX_M = measured
    if a.w8a16_max_m is not None:
        gemm_mod.W8A16_MAX_M = a.w8a16_max_m
    if "gemm" in only:
        for name in a.table.split(","):
            if name == a.decode_table or a.smoke:  # (smoke: the tiny shapes stand in for either table)
                tshapes = shapes
            else:
                tshapes = [Shape(n, N, K, dev, a.smoke) for n, (N, K) in TABLES[name].items()]
            bench_gemm(tshapes, [int(m) for m in a.m.split(",")], timer, dev, bw, log, table=name)
    if "chain" in only:
        if a.smoke:
            cshapes, producers = shapes, dict(zip(SMOKE_SHAPES, [("norm", True), ("silu", False)]))
        else:
            cshapes = [Shape(n, N, K, dev, a.smoke) for n, (N, K) in GLM5_TP8_SERVED.items()]
            producers = GLM5_TP8_PRODUCERS
        # (smoke: 40 rows, past the w8a16 sizes where no producer quantizes)
        bench_chain(cshapes, [int(m) for m in ("40" if a.smoke else a.chain_m).split(",")], timer, dev, log, producers)
    moe_cfg = SMOKE_MOE if a.smoke else MOE_SLICE if a.moe_table == "slice" else MOE
    weights = moe_weights(moe_cfg, dev) if only & {"moe", "sweep", "moe_gemv"} else None
    if "moe" in only:
        moe_limit = bench_moe([int(n) for n in a.moe_n.split(",")], weights, moe_cfg, timer, dev, bw, a.smoke, log)
        log(f"moe: the w8a16 tiles no slower than w8a8 up to N = {moe_limit}")
        moe_mod.MOE_W8A16_MAX_TOKENS = moe_limit
    if "sweep" in only:
        sweep(shapes, timer, dev, a.smoke, log, [int(m) for m in a.sweep_m.split(",")] if not a.smoke else (1, 64, 4096))
        moe_sweep(weights, moe_cfg, timer, dev, a.smoke, log)
    if "moe_gemv" in only:
        moe_gemv_sweep([int(n) for n in a.moe_n.split(",")], weights, moe_cfg, timer, dev, a.smoke, log)
    log("done")
    print_tables(bw)


if __name__ == "__main__":
    main()

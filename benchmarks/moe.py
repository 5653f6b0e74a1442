"""Fused MoE benchmark (issue 16): the Triton grouped GEMM (`kernels/moe_triton.py`) against the
per-expert loop (`moe_experts_reference`) and the hardware limits measured in the same run, at
GLM-5 widths (H 6144, I 2048, top-8, bf16) on a CUDA device.

For every (N tokens, E experts): the kernel's result against the reference in fp32 (relative
error; also the bf16 loop's own error, for scale); a run under
`torch.cuda.set_sync_debug_mode("error")` (any host sync raises); then times:

- `fused` — CUDA-graph replays of the op (sorting, both GEMMs and the sum: everything it
  launches), `eager` — plain calls, `loop` — the per-expert loop (host sync per call: eager);
- `dense` — bf16 `torch.mm` with the same FLOPs (N·k rows through one expert's gate+up and down
  stacked as dense matrices): the matrix-unit roofline at this shape;
- `floor` — the bytes the op must read (the weights of every expert hit, x, the output) over the
  device-to-device copy bandwidth measured here: the memory roofline (what bounds decode).

Tile sweeps (`--sweep`): every listed `MoEConfig` is checked, then timed.

    python benchmarks/moe.py [--n 1,64,4096] [--experts 16,32] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from glm53.kernels.moe import moe_experts_reference
from glm53.kernels.moe_triton import MoEConfig, default_config, moe_experts_triton

H, I, TOPK = 6144, 2048, 8
ROWS: list[dict] = []

SWEEP = {  # by expected rows per expert: decode (<= 16), small batches (<= 64), prefill
    "small": [MoEConfig(16, 32, 64, 256, num_warps=4, num_stages=3), MoEConfig(16, 128, 128, 64, num_warps=4, num_stages=4),
              MoEConfig(16, 64, 128, 128, num_warps=8, num_stages=3)],
    "mid": [MoEConfig(32, 64, 64, 128, num_warps=4, num_stages=4), MoEConfig(64, 128, 128, 64, num_warps=4, num_stages=4),
            MoEConfig(16, 64, 64, 128, num_warps=4, num_stages=4)],
    "large": [MoEConfig(128, 64, 128, 64, num_warps=8, num_stages=4), MoEConfig(128, 128, 256, 64, num_warps=8, num_stages=3),
              MoEConfig(64, 128, 128, 64, num_warps=4, num_stages=4, GROUP_M=16)],
}


def _events_median(fn, reps: int) -> float:
    """Median ms of `fn` between CUDA events (fn already warmed up)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def graph_ms(fn, calls: int = 10, reps: int = 20) -> float:
    """Median ms per call of a CUDA graph holding `calls` calls of fn (launch gaps amortized)."""
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = _events_median(g.replay, reps) / calls
    del g
    return t


def eager_ms(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    return _events_median(fn, reps)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = eager_ms(lambda: b.copy_(a), reps=10)
    return 2 * a.numel() / (ms * 1e-3)


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = eager_ms(lambda: a @ b, reps=10)
    return 2 * 8192**3 / (ms * 1e-3)


def inputs(N: int, E: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(N, E, device="cuda", generator=g).argsort(dim=1)[:, :TOPK]
    x = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    w = torch.rand(N, TOPK, device="cuda", generator=g) + 0.05
    gate = (torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5).to(dtype)
    up = (torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).to(dtype)
    return x, w, ids, gate, up, down


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench(N: int, E: int, bw: float, sweep: bool, log) -> None:
    t0 = time.time()
    args = inputs(N, E)
    x, w, ids, gate, up, down = args
    ref = moe_experts_reference(x.float(), w, ids, gate.float(), up.float(), down.float())
    loop_out = moe_experts_reference(*args)
    cfg = default_config(N * TOPK, E, x.dtype)
    out = moe_experts_triton(*args)
    err, loop_err = rel(out, ref), rel(loop_out, ref)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_experts_triton(*args)
        torch.cuda.synchronize()
        sync_free = True
    except RuntimeError as e:  # a host sync inside the op
        sync_free = f"no: {str(e).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    hit = int(torch.unique(ids).numel())
    M = N * TOPK
    flops = 2 * M * H * I * 3
    bytes_ = hit * 3 * I * H * 2 + N * H * 2 * 2
    floor_ms = bytes_ / bw * 1e3
    fused = graph_ms(lambda: moe_experts_triton(*args))
    eager = eager_ms(lambda: moe_experts_triton(*args))
    loop = eager_ms(lambda: moe_experts_reference(*args), reps=5)
    # dense: the same FLOPs through one expert's weights stacked [H, 2I] and [I, H]
    xa = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    wgu = torch.cat([gate[0], up[0]]).t()
    ha = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)
    wd = down[0].t()
    dense = graph_ms(lambda: (xa @ wgu, ha @ wd))
    row = dict(N=N, E=E, experts_hit=hit, config=cfg.__dict__, rel_err=err, loop_rel_err=loop_err,
               sync_free=sync_free, fused_ms=fused, eager_ms=eager, loop_ms=loop, dense_ms=dense,
               floor_ms=floor_ms, tflops=flops / fused * 1e-9, dense_tflops=flops / dense * 1e-9,
               hbm_share=floor_ms / fused)
    if sweep:
        rows = N * TOPK / E
        kind = "small" if rows <= 16 else "mid" if rows <= 64 else "large"
        row["sweep"] = []
        for c in SWEEP[kind]:
            try:
                e = rel(moe_experts_triton(*args, config=c), ref)
                ms = graph_ms(lambda: moe_experts_triton(*args, config=c)) if e < 1e-2 else float("nan")
            except Exception as ex:  # e.g. out of shared memory: report, go on
                e, ms = float("nan"), f"{type(ex).__name__}: {str(ex)[:80]}"
            row["sweep"].append(dict(config=c.__dict__, rel_err=e, fused_ms=ms))
    ROWS.append(row)
    log(f"N={N} E={E}: err {err:.2e} (loop {loop_err:.2e}), sync-free {sync_free}, fused {fused:.3f} ms, "
        f"eager {eager:.3f}, loop {loop:.3f}, dense {dense:.3f}, floor {floor_ms:.3f} ({time.time() - t0:.0f} s)")
    for s in row.get("sweep", []):
        log(f"    sweep {s['config']}: err {s['rel_err']:.2e}, {s['fused_ms']}")


def check_fp32(log) -> None:
    args = inputs(33, 16, torch.float32, seed=1)
    out = moe_experts_triton(*args)
    x, w, ids, gate, up, down = (t.double() if t.is_floating_point() else t for t in args)
    err = ((out.double() - moe_experts_reference(x, w, ids, gate, up, down)).norm()
           / moe_experts_reference(x, w, ids, gate, up, down).norm()).item()
    ROWS.append(dict(check="fp32 N=33 E=16", rel_err=err))
    log(f"fp32 N=33 E=16 against float64: err {err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="1,64,4096")
    ap.add_argument("--experts", default="16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    def log(s: str) -> None:
        print(s, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(env=env, rows=ROWS), f, indent=1, default=str)

    bw, peak = copy_bandwidth(), matmul_peak()
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_TBps=bw / 1e12,
               matmul_TFLOPs=peak / 1e12)
    log(f"{env['device']}: copy {bw / 1e12:.2f} TB/s, bf16 8192^3 matmul {peak / 1e12:.0f} TFLOP/s")
    for E in (int(e) for e in a.experts.split(",")):
        for N in (int(n) for n in a.n.split(",")):
            bench(N, E, bw, a.sweep, log)
    check_fp32(log)
    print("\n| N | E | hit | fused ms | eager ms | loop ms | dense ms | floor ms | fused TFLOP/s | floor/fused | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        if "N" in r:
            print(f"| {r['N']} | {r['E']} | {r['experts_hit']} | {r['fused_ms']:.3f} | {r['eager_ms']:.3f} | "
                  f"{r['loop_ms']:.3f} | {r['dense_ms']:.3f} | {r['floor_ms']:.3f} | {r['tflops']:.0f} | "
                  f"{r['hbm_share']:.0%} | {r['rel_err']:.1e} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

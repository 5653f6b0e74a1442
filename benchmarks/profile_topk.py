"""Profile the Triton top-k's launches with Nsight Compute (on the device machine, where ncu reads
the hardware counters), and summarize the counters that explain a kernel's time.

    ncu --clock-control none --set full --csv --page raw -k regex:'bracket|scan|finish' -c 3 \\
        python benchmarks/profile_topk.py run 1 32768 > b1.csv
    python benchmarks/profile_topk.py parse b1.csv
    ncu --clock-control none --set full --import-source no --page source --print-source sass --csv \
        -k regex:finish -c 1 python benchmarks/profile_topk.py run 1 131072 > fin.csv
    python benchmarks/profile_topk.py hot fin.csv

A/B of top-k variants in one process (CUDA-graph replays over rotating input sets, each variant
checked for exact sets first on ragged, tied, special, trending and paged rows), with `torch.topk`
and a plain streaming read of the same grid beside (the floor):

    export TRITON_CACHE_DIR=/tmp/tc  # the compiles first, shared out to parallel processes:
    for i in $(seq 0 13); do python benchmarks/profile_topk.py warm $i 14 & done; wait
    python benchmarks/profile_topk.py ab [OUT.jsonl] [BASE_MODULE.py]

BASE_MODULE (optional): another copy of `topk_triton.py` timed beside the current one.
"""

from __future__ import annotations

import csv
import sys

STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "lg_throttle",
          "mio_throttle", "membar", "not_selected", "selected", "dispatch_stall", "no_instruction", "branch_resolving",
          "drain", "sleeping", "tex_throttle", "imc_miss", "misc")
WANT = {
    "gpu__time_duration.sum": "us",
    "launch__registers_per_thread": "regs",
    "launch__grid_size": "grid",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy%",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
    "smsp__inst_executed.sum": "warp_inst",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cyc/inst",
}


def run(B: int, L: int, reps: int = 3) -> None:
    import torch

    from glm53.kernels.topk_triton import topk_triton

    x = torch.randn(B, L, device="cuda")
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    for _ in range(reps):
        topk_triton(x, lens, 2048)
    torch.cuda.synchronize()


def _op(text: str) -> str:
    t = text.split()
    op = t[1] if t and t[0].startswith("@") else (t[0] if t else "?")
    return op.split(".")[0]


def hot(path: str, seg: int = 200) -> None:
    """Where a kernel's instructions go, from a `--page source --print-source sass` export:
    warp instructions executed, by opcode and by segments of `seg` SASS lines (short kernels get
    too few stall samples for the sampling columns to say much)."""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"')), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print("no rows in", path)
        return
    ie = [int((r.get("Instructions Executed") or "0").replace(",", "") or 0) for r in rows]
    ops = [_op(r["Source"]) for r in rows]
    total = sum(ie) or 1
    by_op: dict[str, int] = {}
    for v, op in zip(ie, ops):
        by_op[op] = by_op.get(op, 0) + v
    print(f"{path}: {total} warp instructions, {len(rows)} SASS lines")
    print("  by opcode:", ", ".join(f"{k}={100 * v / total:.1f}%" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:14]))
    for i in range(0, len(rows), seg):
        v = sum(ie[i:i + seg])
        if v > 0.02 * total:
            part: dict[str, int] = {}
            for x, op in zip(ie[i:i + seg], ops[i:i + seg]):
                part[op] = part.get(op, 0) + x
            top = ", ".join(f"{k}:{n}" for k, n in sorted(part.items(), key=lambda kv: -kv[1])[:6])
            print(f"  lines {i:5d}-{i + seg:5d}: {100 * v / total:5.1f}%  {top}")


def parse(path: str) -> None:
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]  # drop ncu's own log lines
    rows = list(csv.DictReader(lines))
    for r in rows[1:]:  # row 0 holds the units
        name = r.get("Kernel Name", "?")
        parts = [name[:24]]
        for key, label in WANT.items():
            if key in r:
                v = r[key].replace(",", "")
                if key == "gpu__time_duration.sum":
                    v = f"{float(v) / 1e3:.2f}" if r.get(key) and rows[0][key] == "nsecond" else v
                parts.append(f"{label}={v}")
        stalls = []
        for s in STALLS:
            key = f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"
            if key in r and r[key]:
                stalls.append((float(r[key].replace(",", "")), s))
        stalls.sort(reverse=True)
        parts.append("stalls: " + ", ".join(f"{s}={v:.1f}" for v, s in stalls[:5]))
        print(" | ".join(parts))


AB_SHAPES = [(B, L) for B in (1, 8, 64) for L in (8192, 32768, 131072)]
KNOB_SHAPES = ((8, 131072), (64, 32768), (64, 131072))
# the scan split into smaller programs (fewer warps, more chunks a row: cheaper block barriers),
# the finish's candidate tile on 16 warps, the bracket on 32
KNOBS = {
    "w4c16": dict(num_warps=4, block=1024, chunks=16, finish_warps=8),
    "w4c16fw16": dict(num_warps=4, block=1024, chunks=16, finish_warps=16),
    "w4c16pf2": dict(num_warps=4, block=1024, chunks=16, finish_warps=8, scan_prefetch=2),
    "w4c8": dict(num_warps=4, block=1024, chunks=8, finish_warps=8),
    "ct8kfw16": dict(cand_total=8192, finish_warps=16),
    "bw32": dict(bracket_warps=32),
}


def _ab_variants(k, base=None):
    """The variants `ab` times: the default on every shape, the knobs on KNOB_SHAPES."""
    from glm53.kernels import topk_triton as tt

    fns = {"default": lambda x, lens, **kw: tt.topk_triton(x, lens, k, **kw)}
    for name, knobs in KNOBS.items():
        fns[name] = lambda x, lens, knobs=knobs, **kw: tt.topk_triton(x, lens, k, **knobs, **kw)
    if base is not None:
        fns["base"] = lambda x, lens, **kw: base.topk_triton(x, lens, k, **kw)
    return fns


def _ab_jobs(fns):
    return [(B, L, name) for B, L in AB_SHAPES for name in fns if name == "default" or (B, L) in KNOB_SHAPES]


def warm(i: int, n: int) -> None:
    """Compile share i of n of `ab`'s kernels (processes in parallel fill TRITON_CACHE_DIR)."""
    import torch

    fns = _ab_variants(2048)
    for B, L, name in _ab_jobs(fns)[i::n]:
        x = torch.randn(B, L, device="cuda")
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        fns[name](x, lens)
        if (B, L) == (64, 131072):  # the paged check's finish
            fns[name](x, lens, page_table=torch.zeros(B, L // 64, dtype=torch.int32, device="cuda"), page_size=64)
    torch.cuda.synchronize()


def _load_base(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("topk_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["topk_base"] = mod
    spec.loader.exec_module(mod)
    return mod


def _read_floor_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _read_floor(x_ptr, out_ptr, L, CHUNK, C, BLOCK: tl.constexpr):
        """Each program streams one chunk of its row and counts scores above 2: the scan's bytes
        with next to no work per score."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        row = x_ptr + b.to(tl.int64) * L
        for s in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, L), BLOCK):
            acc += (tl.load(row + s + tl.arange(0, BLOCK)) > 2.0).to(tl.int32)
        tl.store(out_ptr + b * C + c, tl.sum(acc, axis=0))

    return _read_floor


def ab(out_path: str | None = None, base_path: str | None = None) -> None:
    import json
    import math

    import torch

    from glm53.kernels import topk_triton as tt
    from glm53.kernels.topk import dsa_topk_reference, positions_to_slots
    from glm53.support.cuda_timing import graph_ms
    from tests.kernels.cases import make_logits

    k = 2048
    base = _load_base(base_path) if base_path else None
    fout = open(out_path, "w") if out_path else None

    def emit(row):
        print(json.dumps(row), flush=True)
        if fout:
            fout.write(json.dumps(row) + "\n")
            fout.flush()

    fns = _ab_variants(k, base)

    # exactness: fresh inputs, ragged lengths (0, < k, = k, k + 1, L - 1, L), ties, -inf, trends;
    # and the paged output (physical slots)
    torch.manual_seed(1234)
    bad = []
    for B, L in ((64, 131072), (8, 32768)):
        for kind in ("randn", "ties", "coarse", "special", "trend", "falling"):
            x = make_logits(B, L, kind, torch.float32, "cuda", row_stride_pad=16)  # (the timed specialization)
            lens = torch.randint(1, L + 1, (B,), device="cuda", dtype=torch.int32)
            lens[:6] = torch.tensor([L, L - 1, 0, k - 1, k, k + 1], dtype=torch.int32)
            ref = dsa_topk_reference(x, lens, k)
            pt = torch.stack([torch.randperm(4 * L // 64, device="cuda")[:L // 64] for _ in range(B)]).int()
            refs = [ref.sort(dim=1).values, positions_to_slots(ref, pt, 64).sort(dim=1).values]
            for name, fn in fns.items():
                if name == "base" or (name != "default" and (B, L) not in KNOB_SHAPES):
                    continue
                for paged in (False, True) if (B, L) == (64, 131072) and kind in ("randn", "trend") else (False,):
                    kw = dict(page_table=pt, page_size=64) if paged else {}
                    ok = bool(torch.equal(fn(x, lens, **kw).sort(dim=1).values, refs[paged]))
                    if not ok:
                        bad.append((name, B, L, kind, paged))
                    emit({"check": name, "B": B, "L": L, "kind": kind, "paged": paged, "exact": ok})
    # timing: rotating input sets (>= ~4x the L2 where memory allows)
    rows = []
    for B, L in AB_SHAPES:
        ns = max(1, min(8, math.ceil(4 * (60 << 20) / (B * L * 4))))
        xs = [torch.randn(B, L, device="cuda") for _ in range(ns)]
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        row = {"B": B, "L": L}
        for name, fn in fns.items():
            if name == "default" or (B, L) in KNOB_SHAPES:
                row[name] = round(graph_ms([lambda x=x, fn=fn: fn(x, lens) for x in xs]) * 1e3, 2)
        row["torch_topk"] = round(graph_ms([lambda x=x: torch.topk(x, k, dim=-1) for x in xs]) * 1e3, 2)
        if (B, L) in KNOB_SHAPES:
            C, chunk = tt._chunks(B, L, xs[0].device, tt.BLOCK, tt.MAX_CHUNKS)
            cnt = torch.empty(B * C, dtype=torch.int32, device="cuda")
            rf = _read_floor_kernel()
            row["read_floor"] = round(graph_ms([lambda x=x: rf[(B, C)](x, cnt, L, chunk, C, BLOCK=2048, num_warps=8)
                                                for x in xs]) * 1e3, 2)
        emit(row)
        rows.append(row)
        del xs
    cols = list(fns) + ["torch_topk", "read_floor"]
    print(f"{'B':>3} {'L':>7} " + " ".join(f"{n:>11}" for n in cols))
    for r in rows:
        print(f"{r['B']:>3} {r['L']:>7} " + " ".join(f"{r.get(n, ''):>11}" for n in cols))
    print("MISMATCHES:", bad if bad else "none")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "hot":
        hot(sys.argv[2])
    elif sys.argv[1] == "warm":
        warm(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "ab":
        ab(*sys.argv[2:4])
    else:
        parse(sys.argv[2])

"""Profile the Triton top-k's launches with Nsight Compute (on the device machine, where ncu reads
the hardware counters), and summarize the counters that explain a kernel's time.

    ncu --clock-control none --set full --csv --page raw -k regex:'bracket|scan|finish' -c 3 \\
        python benchmarks/profile_topk.py run 1 32768 > b1.csv
    python benchmarks/profile_topk.py parse b1.csv
    ncu --clock-control none --set full --import-source no --page source --print-source sass --csv \
        -k regex:finish -c 1 python benchmarks/profile_topk.py run 1 131072 > fin.csv
    python benchmarks/profile_topk.py hot fin.csv
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


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "hot":
        hot(sys.argv[2])
    else:
        parse(sys.argv[2])

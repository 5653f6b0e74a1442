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


def hot(path: str, top: int = 30) -> None:
    """Hot SASS lines of a `--page source --print-source sass` export: warp-stall samples per
    instruction, summed by opcode, and the hottest lines with their neighbours' opcodes."""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"')), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print("no rows in", path)
        return
    cols = list(rows[0])
    scol = next((c for c in cols if "Sampling" in c and "All" in c), None) or next(c for c in cols if "Sampling" in c)
    src = next(c for c in cols if c.strip() == "Source")
    samples = [(float((r.get(scol) or "0").replace(",", "") or 0), r[src]) for r in rows]
    total = sum(v for v, _ in samples) or 1.0
    by_op: dict[str, float] = {}
    for v, text in samples:
        op = text.split()[0] if text.split() else "?"
        if op.startswith("@"):
            op = text.split()[1]
        by_op[op.split(".")[0]] = by_op.get(op.split(".")[0], 0.0) + v
    print(f"{path}: {int(total)} samples ({scol})")
    print("  by opcode:", ", ".join(f"{k}={100 * v / total:.1f}%" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:14]))
    ranked = sorted(range(len(samples)), key=lambda i: -samples[i][0])[:top]
    for i in sorted(ranked):
        print(f"  {i:5d} {100 * samples[i][0] / total:5.1f}%  {samples[i][1][:70]}")


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

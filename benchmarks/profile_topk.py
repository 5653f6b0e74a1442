"""Profile the Triton top-k's launches with Nsight Compute (on the device machine, where ncu reads
the hardware counters), and summarize the counters that explain a kernel's time.

    ncu --clock-control none --set full --csv --page raw -k regex:'bracket|scan|finish' -c 3 \\
        python benchmarks/profile_topk.py run 1 32768 > b1.csv
    python benchmarks/profile_topk.py parse b1.csv
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
    else:
        parse(sys.argv[2])

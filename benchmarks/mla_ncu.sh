#!/usr/bin/env bash
# Profile the sparse MLA kernel (T=64, H=64, 2048 slots) with Nsight Compute and print its top
# warp stall reasons and a few headline metrics. From the repo root on the GPU machine:
#   PYTHONPATH=. bash benchmarks/mla_ncu.sh [kwargs, e.g. kernel=tl,block_n=32,num_stages=5]
# The first kernel launches (compile, check) are skipped; one launch of the main kernel is profiled.
set -euo pipefail
CFG="${1:-}"
OUT="${OUT:-/tmp}/mla_ncu_$$.csv"
ncu --clock-control none --set full -k regex:_sparse_mla_ --launch-skip 1 --launch-count 1 \
    --csv --page raw python benchmarks/mla_ncu.py --cfg "$CFG" --reps 2 > "$OUT"
grep -v '^"' "$OUT" || true  # the script's own lines (rel err)
python - "$OUT" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, units, vals = rows[0], rows[1], rows[2]  # header, units, the profiled launch
m = dict(zip(head, vals))
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return None
for key in ("gpu__time_duration.sum", "launch__registers_per_thread", "launch__shared_mem_per_block_dynamic",
            "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem", "sm__warps_active.avg.pct_of_peak_sustained_active",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sector_hit_rate.pct",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed", "sm__inst_executed.sum",
            "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
            "smsp__issue_active.avg.pct_of_peak_sustained_active", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
            "local_load_bytes", "smsp__sass_inst_executed_op_local_ld.sum"):
    if key in m:
        print(f"{key:70s} {m[key]}")
stall = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
ranked = sorted(((num(v) or 0.0, stall.match(k).group(1)) for k, v in m.items() if stall.match(k)), reverse=True)
print("top stall reasons (warps stalled per issued instruction):")
for v, name in ranked[:8]:
    print(f"  {name:28s} {v:.3f}")
PY

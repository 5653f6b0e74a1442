"""GPU kernel time under `torch.profiler`: run a step function under the profiler (`profile`), sum
and rank its CUDA kernels per step (`kernel_table`) and print them (`print_table`). Used by
benchmarks/gpu_profile.py, benchmarks/spec_steps.py and tools/eval_dflash.py.
"""

from __future__ import annotations

import torch


def kernel_table(prof, steps: int, top: int) -> tuple[float, list[dict]]:
    """(GPU kernel µs per step, [{name, us_per_step, calls_per_step}] largest first)."""
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if us <= 0 or ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows.append({"name": ev.key[:110], "us_per_step": us / steps, "calls_per_step": ev.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return sum(r["us_per_step"] for r in rows), rows[:top]


def print_table(title: str, total_us: float, rows: list[dict]) -> None:
    print(f"{title}: GPU kernels {total_us:8.1f} us/step", flush=True)
    for r in rows:
        print(f"   {r['us_per_step']:8.1f} us {r['calls_per_step']:5.1f}x  {r['name']}", flush=True)


def profile(fn, steps: int):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof

"""GPU kernel time under `torch.profiler`: run a step function under the profiler (`profile`), sum
and rank its CUDA kernels per step (`kernel_table`), count them (`launch_counts`) and print them
(`print_table`). Used by benchmarks/gpu_profile.py, benchmarks/spec_steps.py and
tools/eval_dflash.py.
"""

from __future__ import annotations

import torch


def _kernels(prof):
    """(event, its total µs) of every CUDA kernel the profiler recorded (grouped by name)."""
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if us > 0 and ev.device_type == torch.autograd.DeviceType.CUDA and ev.count:
            yield ev, us


def kernel_table(prof, steps: int, top: int) -> tuple[float, list[dict]]:
    """(GPU kernel µs per step, [{name, us_per_step, calls_per_step}] largest first)."""
    rows = [{"name": ev.key[:110], "us_per_step": us / steps, "calls_per_step": ev.count / steps}
            for ev, us in _kernels(prof)]
    rows.sort(key=lambda r: -r["us_per_step"])
    return sum(r["us_per_step"] for r in rows), rows[:top]


def launch_counts(prof, steps: int, short_us: float = 8.0) -> dict:
    """Kernels per step, and how many of them (and their µs per step) average under `short_us`:
    a step made of many short kernels is bound by launch gaps, not by the bytes it reads."""
    calls = short = short_time = 0.0
    for ev, us in _kernels(prof):
        calls += ev.count
        if us / ev.count < short_us:
            short += ev.count
            short_time += us
    return {"kernels_per_step": calls / steps, f"under_{short_us:g}us_per_step": short / steps,
            f"under_{short_us:g}us_time_us": short_time / steps}


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


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """µs per replay of `graph` replayed `replays` times back to back between two CUDA events: its
    GPU time with no host work between replays."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / replays * 1e3

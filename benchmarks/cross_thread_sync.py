"""How one thread's wait for its GPU work delays another thread's CUDA calls (issue 33 item 1: a
colocated pair's decode loop stalled for about one queued prefill chunk).

Thread A (prefill's role) queues ~`--ms` of work on its stream, then reads a small result back
by one of several methods and waits. Thread B (decode's role), on its own high-priority stream,
meanwhile runs a loop that each time launches a small kernel, copies 64 ints host-to-device
(pinned, non_blocking), records an event and waits on it: the calls a decode step makes. Reported
per method: B's longest loop iteration and its longest single call while A waited (~0 ms:
independent; ~`--ms`: B's calls waited for A's queue), and the time A took.

    python3 benchmarks/cross_thread_sync.py [--ms 100] [--green 48]

`--green N`: A's stream on a green context of N SMs, as in the colocated pair.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from glm53.models.readback import readback


def method_calls(name: str, t: torch.Tensor):
    if name == "tolist (pageable D2H)":
        return lambda: t.tolist()
    if name == "cpu() (pageable D2H)":
        return lambda: t.cpu()
    if name == "item()":
        return lambda: t[0].item()
    if name == "stream.synchronize()":
        return lambda: torch.cuda.current_stream().synchronize()
    if name == "pinned copy + event.synchronize (readback)":
        return lambda: readback(t).tolist()
    if name == "none (A only sleeps on the host)":
        return lambda: time.sleep(0.12)
    raise ValueError(name)


METHODS = ["none (A only sleeps on the host)", "tolist (pageable D2H)", "cpu() (pageable D2H)", "item()",
           "stream.synchronize()", "pinned copy + event.synchronize (readback)"]


def run(name: str, a: torch.cuda.Stream, b: torch.cuda.Stream, cycles: int) -> dict:
    src = torch.arange(64, dtype=torch.long).pin_memory()
    dst = torch.empty(64, dtype=torch.long, device="cuda")
    x = torch.zeros(4096, device="cuda")
    with torch.cuda.stream(a):
        small = torch.arange(16, device="cuda")
    torch.cuda.synchronize()
    stop = threading.Event()
    worst = {"iter": 0.0, "launch": 0.0, "h2d": 0.0, "record": 0.0, "sync": 0.0}

    def decode_loop():
        torch.cuda.set_stream(b)
        while not stop.is_set():
            t0 = time.perf_counter()
            x.add_(1)
            t1 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            t2 = time.perf_counter()
            ev = torch.cuda.Event()
            ev.record()
            t3 = time.perf_counter()
            ev.synchronize()
            t4 = time.perf_counter()
            for k, v in (("launch", t1 - t0), ("h2d", t2 - t1), ("record", t3 - t2), ("sync", t4 - t3), ("iter", t4 - t0)):
                worst[k] = max(worst[k], v)
            time.sleep(0.0005)

    th = threading.Thread(target=decode_loop)
    th.start()
    time.sleep(0.05)
    for k in worst:
        worst[k] = 0.0
    took = []
    fn = method_calls(name, small)
    with torch.cuda.stream(a):
        for _ in range(3):
            t0 = time.perf_counter()
            torch.cuda._sleep(cycles)
            small.add_(1)
            fn()
            took.append(time.perf_counter() - t0)
            time.sleep(0.02)
    stop.set()
    th.join()
    torch.cuda.synchronize()
    return {"method": name, "a_ms": max(took) * 1e3, **{f"b_{k}_ms": v * 1e3 for k, v in worst.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", type=float, default=100.0, help="work queued on A before each read-back")
    ap.add_argument("--green", type=int, default=0, metavar="SMS", help="A on a green context of SMS SMs")
    a_ = ap.parse_args()
    torch.cuda.init()
    if a_.green:
        from torch.cuda import green_contexts

        green = green_contexts.GreenContext.create(num_sms=a_.green, device_id=0)  # kept: its stream dies with it
        a = green.Stream()
    else:
        a = torch.cuda.Stream()
    b = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    # cycles for ~ms: calibrate torch.cuda._sleep on this GPU
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    per_ms = 100_000_000 / ((time.perf_counter() - t0) * 1e3)
    cycles = int(per_ms * a_.ms)
    print(f"A: {a_.ms:.0f} ms of work per read-back ({'green context of %d SMs' % a_.green if a_.green else 'a plain stream'})")
    print(f"{'A reads back by':45s} {'A ms':>7s} | B longest: {'iter':>7s} {'launch':>7s} {'h2d':>7s} {'record':>7s} {'sync':>7s} ms")
    for m in METHODS:
        r = run(m, a, b, cycles)
        print(f"{m:45s} {r['a_ms']:7.1f} | {'':12s}{r['b_iter_ms']:7.1f} {r['b_launch_ms']:7.1f} {r['b_h2d_ms']:7.1f} "
              f"{r['b_record_ms']:7.1f} {r['b_sync_ms']:7.1f}", flush=True)


if __name__ == "__main__":
    main()

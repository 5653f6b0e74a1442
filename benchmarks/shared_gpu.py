"""Decode beside prefill on one GPU: what the decode step costs while prefill runs on the same GPU,
with prefill in another process (the GPU time-slices between the two contexts) or in the same
process on a lower-priority CUDA stream (the block scheduler serves decode's kernels first).

    PYTHONPATH=. python3 benchmarks/shared_gpu.py --slice DIR [--bs 64] [--ctx 4096] [--chunk 4096] [--out FILE]

Decode is the slice's graphed step at batch `bs` over `ctx`-token contexts, timed as the serving
loop runs it (forward, argmax, the tokens back to the host); prefill is `chunk`-token forwards
back to back. Printed per variant: the decode step's median and p90, its ratio to the HBM floor
measured in the same run (hbm_floor.step_bytes at the device copy bandwidth), and prefill's chunk
time and tokens/s. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


def load(slice_dir: str):
    from glm53.models import ModelRunner

    return ModelRunner.from_dir(slice_dir, page_size=64, num_pages=1, device="cuda", progress=False).model


class Prefill:
    """Back-to-back prefill chunks of one prompt in a thread, on `stream`."""

    def __init__(self, model, chunk: int, stream: torch.cuda.Stream):
        from glm53.models import ModelRunner

        self.pages = -(-chunk // 64)
        self.runner = ModelRunner(model, num_pages=self.pages, page_size=64, device="cuda")
        self.tokens = torch.randint(10, model.cfg.vocab_size - 10, (chunk,)).tolist()
        self.stream, self.times = stream, []
        self.stop, self.started = threading.Event(), threading.Event()

    def launch(self) -> torch.cuda.Event:
        """One chunk's forward queued on the current stream; the event marks its end."""
        from glm53.models import SeqChunk

        self.runner.forward([SeqChunk(self.tokens, 0, list(range(self.pages)))])
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def chunk(self) -> float:
        t = time.perf_counter()
        self.launch().synchronize()
        return time.perf_counter() - t

    def run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.times.append(self.chunk())
                self.started.set()


class Decode:
    """The graphed decode step at batch `bs`, as the serving loop times it."""

    def __init__(self, model, bs: int, ctx: int, steps: int):
        from glm53.models import ModelRunner
        from glm53.models.graph import GraphConfig

        self.bs, self.ctx = bs, ctx
        self.need = -(-(ctx + 4 * steps + 64) // 64)
        self.runner = ModelRunner(model, num_pages=self.need * bs, page_size=64, device="cuda",
                                  graphs=GraphConfig(max_bs=bs, max_context=self.need * 64))
        for _, pool in self.runner.pools:  # random KV: realistic indexer scores
            pool.tensor.normal_()
        self.pos, self.toks = ctx, [1] * bs

    def steps(self, n: int) -> list[float]:
        from glm53.models import SeqChunk

        times = []
        for _ in range(n):
            chunks = [SeqChunk([self.toks[i]], self.pos, list(range(i * self.need, (i + 1) * self.need)))
                      for i in range(self.bs)]
            t = time.perf_counter()
            logits = self.runner.forward(chunks)
            self.toks = torch.cat(logits).argmax(-1).tolist()
            times.append(time.perf_counter() - t)
            self.pos += 1
        return times


def summary(times: list[float]) -> dict:
    s = sorted(times)
    return {"n": len(s), "p50_ms": statistics.median(s) * 1e3, "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3}


def child(slice_dir: str, chunk: int) -> None:
    """The other process's prefill loop: runs until stdin closes, then prints its chunk times."""
    torch.set_grad_enabled(False)
    p = Prefill(load(slice_dir), chunk, torch.cuda.Stream())
    th = threading.Thread(target=p.run, daemon=True)
    th.start()
    p.started.wait(600)
    print("ready", flush=True)
    sys.stdin.read()
    p.stop.set()
    th.join(60)
    print(json.dumps(p.times), flush=True)


def beside_process(args, dec: Decode) -> tuple[dict, dict]:
    proc = subprocess.Popen([sys.executable, __file__, "--slice", args.slice, "--chunk", str(args.chunk),
                             "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("prefill process did not start")
        times = dec.steps(args.steps)
        proc.stdin.close()
        out = proc.stdout.read()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    chunks = json.loads(out.strip().splitlines()[-1])[1:]
    return summary(times), summary(chunks)


def beside_thread(args, model, dec: Decode, ps: torch.cuda.Stream, ds: torch.cuda.Stream,
                  switch: float) -> tuple[dict, dict]:
    """Prefill chunks back to back in a thread on stream `ps`, decode steps on `ds` meanwhile."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch)
    p = Prefill(model, args.chunk, ps)
    th = threading.Thread(target=p.run, daemon=True)
    th.start()
    try:
        if not p.started.wait(600):
            raise RuntimeError("prefill thread did not start")
        with torch.cuda.stream(ds):
            times = dec.steps(args.steps)
    finally:
        p.stop.set()
        th.join(120)
        sys.setswitchinterval(old)
    return summary(times), summary(p.times[1:])


def beside_launched(args, model, dec: Decode, ps: torch.cuda.Stream, ds: torch.cuda.Stream,
                    chunks: int = 8) -> tuple[dict, dict]:
    """One thread: a prefill chunk is queued on `ps`, then decode steps run on `ds` until the GPU
    has finished it. No GIL to share: what the decode step costs here is the GPU's doing."""
    p = Prefill(model, args.chunk, ps)
    times, spans, launch = [], [], []
    with torch.cuda.stream(ds):
        for _ in range(chunks):
            t = time.perf_counter()
            with torch.cuda.stream(p.stream):
                ev = p.launch()
            launch.append(time.perf_counter() - t)
            while not ev.query():
                times += dec.steps(1)
            spans.append(time.perf_counter() - t)
    print(f"  prefill launch (host) p50 {statistics.median(launch) * 1e3:.1f} ms of a "
          f"{statistics.median(spans) * 1e3:.1f} ms span", flush=True)
    return summary(times[chunks:]), summary(spans[1:])


def prefill_alone(model, chunk: int, stream: torch.cuda.Stream) -> dict:
    """Prefill chunks alone on `stream` (after one to warm up)."""
    p = Prefill(model, chunk, stream)
    with torch.cuda.stream(stream):
        p.chunk()
        return summary([p.chunk() for _ in range(5)])


def priority_streams(prefill_prio: int, decode_prio: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    return torch.cuda.Stream(priority=prefill_prio), torch.cuda.Stream(priority=decode_prio)


def green_streams(prefill_sms: int, decode_sms: int | None) -> tuple[torch.cuda.Stream, torch.cuda.Stream, list]:
    """(prefill stream, decode stream, the contexts to keep alive). Prefill's stream belongs to a
    green context of `prefill_sms` SMs: its kernels run only there, so the other SMs stay free for
    decode. Decode gets a green context of `decode_sms` SMs too, or (None) the whole GPU on a
    high-priority stream. torch splits each green context off the whole device, so two of them
    may share SMs: the numbers say whether they do."""
    from torch.cuda.green_contexts import GreenContext

    pre = GreenContext.create(num_sms=prefill_sms, device_id=0)
    keep = [pre]
    if decode_sms is None:
        ds = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    else:
        keep.append(GreenContext.create(num_sms=decode_sms, device_id=0))
        ds = keep[-1].Stream()
    return pre.Stream(), ds, keep


def green(variant: str, args, model, dec: Decode, prefill_sms: int, decode_sms: int | None) -> tuple[dict, dict]:
    """A variant ("alone": each side alone on its share of the SMs, what the split itself costs;
    "thread"; "launched") with prefill and decode on green-context streams."""
    ps, ds, _contexts = green_streams(prefill_sms, decode_sms)  # the contexts live while this runs
    if variant == "thread":
        return beside_thread(args, model, dec, ps, ds, 5e-4)
    if variant == "launched":
        return beside_launched(args, model, dec, ps, ds, chunks=6)
    with torch.cuda.stream(ds):
        times = dec.steps(args.steps)
    return summary(times), prefill_alone(model, args.chunk, ps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slice", required=True)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--green", nargs="*", default=[], metavar="PREFILL[:DECODE]",
                    help="SM splits to try with green contexts: prefill's SMs, and decode's (else the whole GPU)")
    ap.add_argument("--only-green", action="store_true", help="skip the stream-priority variants")
    args = ap.parse_args()
    if args.child:
        return child(args.slice, args.chunk)
    from glm53.support.hbm_floor import copy_bandwidth, step_bytes

    torch.set_grad_enabled(False)
    bw = copy_bandwidth()
    floor_ms = step_bytes(Path(args.slice), args.bs, args.ctx)["total"] / bw * 1e3
    model = load(args.slice)
    dec = Decode(model, args.bs, args.ctx, 4 * args.steps + 64)
    dec.steps(20)  # warm-up
    low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): numerically high = low priority
    alone = prefill_alone(model, args.chunk, torch.cuda.Stream())
    rows = {"floor_ms": floor_ms, "copy_GBps": bw / 1e9, "prefill_alone": alone,
            "decode_alone": summary(dec.steps(args.steps))}
    variants = {
        "other process": lambda: beside_process(args, dec),
        "same process, prefill low priority": lambda: beside_thread(args, model, dec, *priority_streams(low, high), 0.005),
        "same process, prefill low priority, 0.5 ms GIL switch":
            lambda: beside_thread(args, model, dec, *priority_streams(low, high), 5e-4),
        "same process, equal priority": lambda: beside_thread(args, model, dec, *priority_streams(0, 0), 0.005),
        "one thread, prefill queued at low priority": lambda: beside_launched(args, model, dec, *priority_streams(low, high)),
        "one thread, prefill queued at equal priority": lambda: beside_launched(args, model, dec, *priority_streams(0, 0)),
    }
    if args.only_green:
        variants = {"other process": variants["other process"]}
    for split in args.green:
        pre, _, d = split.partition(":")
        pre, d = int(pre), (int(d) if d else None)
        name = f"prefill {pre} SMs, decode {d or 'all'}"
        for variant, label in (("alone", "green alone"), ("launched", "green, one thread"),
                               ("thread", "green, two threads")):
            variants[f"{label}: {name}"] = lambda v=variant, pre=pre, d=d: green(v, args, model, dec, pre, d)
    print(f"floor {floor_ms:.2f} ms (copy {bw / 1e9:.0f} GB/s); prefill alone {alone['p50_ms']:.1f} ms "
          f"per {args.chunk}-token chunk", flush=True)
    a = rows["decode_alone"]
    print(f"{'decode alone':55s} p50 {a['p50_ms']:6.2f} ms ({a['p50_ms'] / floor_ms:.2f}x floor), "
          f"p90 {a['p90_ms']:6.2f} ms", flush=True)
    for name, fn in variants.items():
        d, p = fn()
        rows[name] = {"decode": d, "prefill": p}
        print(f"{name:55s} p50 {d['p50_ms']:6.2f} ms ({d['p50_ms'] / floor_ms:.2f}x floor), p90 {d['p90_ms']:6.2f} ms; "
              f"prefill {p['p50_ms']:6.1f} ms/chunk = {args.chunk / p['p50_ms'] * 1e3:,.0f} tok/s "
              f"(alone {args.chunk / alone['p50_ms'] * 1e3:,.0f})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

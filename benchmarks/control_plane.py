"""The per-step control plane of a tp > 1 instance on the CPU: what rank 0 spends per step to
hand the step to its follower ranks and get their answers back, against the model's own step.

    PYTHONPATH=. python benchmarks/control_plane.py [--batches 1 16 64 256] [--steps 200]
        [--parts round,step] [--pages-per-request 34] [--gap-ms 0 5]

Part `round` (no model): the control round alone between two gloo rank processes, for decode
batches of N running requests, each with a page table of `--pages-per-request` pages (the
decode scheduler preallocates prompt + max_new_tokens: 34 pages of 16 tokens = 32 + 512
tokens), every step new `SeqChunk`s over the same page lists, as the scheduler builds them;
the follower rebuilds the step and answers with an empty transfer report; between rounds rank 0
does `--gap-ms` of busy host work (the scheduler's sampling and commits) while the follower
waits, as in a server. Variants, interleaved step by step so load from other jobs hits them
alike:

- `gloo, whole Command` — the protocol before step_channel.py: the whole `Command` (every
  request's page table) through `broadcast_object_list`, the answers through `gather_object`;
- `gloo, delta` — step_channel.py's `GlooLink` (the same collectives) carrying the delta;
- `shm, delta` — step_channel.py's `ShmLink` (the default between ranks of one node).

Part `step` (the model): the server's own ranks (`ProcessWorkers`, one thread per rank; tp=1:
`LocalWorkers`) of the embedded model, decode steps of N requests; per step the wall time, the
time rank 0's forward took (its share of the step: `RankRuntime.apply`), and the rest (the
control round and what of it the follower's later start did not hide in rank 0's first
collective), and the empty round (`sync`: no batch, what every scheduler loop pays). Run it on a
checkout before and after a change to compare the protocols on the whole step; the `round` part
compares them within one run.
"""

from __future__ import annotations

import argparse
import datetime
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm53.models import SeqChunk

PAGE = 16
ROUND_VARIANTS = ("gloo, whole Command", "gloo, delta", "shm, delta")


# ---- part `round`: the control round alone ---------------------------------------------------


def _tables(n: int, pages: int) -> list[list[int]]:
    # Page ids as a real allocator hands them out: large, distinct.
    return [list(range(1000 + i * pages, 1000 + (i + 1) * pages)) for i in range(n)]


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _round_rank(rank: int, world: int, port: int, batches: list[int], steps: int, pages: int, gap_ms: float,
                out: str) -> None:
    from glm53.server.engine.processes import Command
    from glm53.server.engine.step_channel import open_follower, open_leader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    alive = lambda: True  # noqa: E731 (a benchmark: both processes outlive it)
    if rank == 0:
        chans = {"gloo, delta": open_leader(group, world, "gloo", 120, alive),
                 "shm, delta": open_leader(group, world, "shm", 120, alive)}
    else:
        chans = {"gloo, delta": open_follower(group, rank, world, 120, alive),
                 "shm, delta": open_follower(group, rank, world, 120, alive)}
    res = {}
    for n in batches:
        tables = _tables(n, pages)
        times: dict[str, list[float]] = {v: [] for v in ROUND_VARIANTS}
        size: dict[str, int] = {}
        pickle_s: list[float] = []
        for step in range(steps + 10):  # 10 warm-up steps
            chunks = [SeqChunk([step % 4000], 32 + step, t) for t in tables]
            cmd = Command([], [chunks])
            for v in ROUND_VARIANTS:
                # No barrier: as in a server, the follower already waits for the step (it answered
                # the last one) while rank 0 does the host work between steps (sampling, commits),
                # here `gap_ms` of busy work.
                if rank == 0:
                    _busy(gap_ms)
                t0 = time.perf_counter()
                if v == "gloo, whole Command":
                    if rank == 0:
                        dist.broadcast_object_list([cmd], src=0, group=group)
                        replies = [None] * world
                        dist.gather_object(({}, None, None), replies, dst=0, group=group)
                    else:
                        box = [None]
                        dist.broadcast_object_list(box, src=0, group=group)
                        assert len(box[0].microbatches[0]) == n
                        dist.gather_object(({}, None, None), None, dst=0, group=group)
                elif rank == 0:
                    chans[v].send(([], [], False), [chunks], None)
                    chans[v].collect()
                else:
                    _, mbs, _ = chans[v].recv()
                    assert len(mbs[0]) == n
                    chans[v].answer(({}, None, None))
                if step >= 10:
                    times[v].append(time.perf_counter() - t0)
            if rank == 0 and step >= 10:
                t0 = time.perf_counter()
                pickle.loads(pickle.dumps(cmd))
                pickle_s.append(time.perf_counter() - t0)
        if rank == 0:
            size["gloo, whole Command"] = len(pickle.dumps(cmd))
            st = chans["shm, delta"].stats
            size["delta"] = st.bytes_sent // st.steps if st.steps else 0
            st.reset()
            chans["gloo, delta"].stats.reset()
            res[n] = {"us": {v: 1e6 * statistics.median(t) for v, t in times.items()},
                      "bytes": size, "pickle_us": 1e6 * statistics.median(pickle_s)}
    if rank == 0:
        Path(out).write_text(repr(res))
    for c in chans.values():
        c.close()
    dist.destroy_process_group()


def part_round(batches: list[int], steps: int, pages: int, gap_ms: float) -> None:
    from glm53.support.ports import free_ports

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "round.txt")
        mp.spawn(_round_rank, args=(2, free_ports(1)[0], batches, steps, pages, gap_ms, out), nprocs=2, join=True)
        res = eval(Path(out).read_text())  # our own repr of plain numbers
    print(f"control round alone, tp=2 (two gloo rank processes, one thread each), decode batches, "
          f"{pages} pages per request, {gap_ms:g} ms of rank-0 host work between rounds, median of {steps} steps (µs)")
    print(f"{'running':>8} | " + " | ".join(f"{v:>19}" for v in ROUND_VARIANTS)
          + " | before ÷ after | Command bytes | delta bytes | pickle+unpickle Command")
    for n, r in res.items():
        us = r["us"]
        print(f"{n:>8} | " + " | ".join(f"{us[v]:>19.0f}" for v in ROUND_VARIANTS)
              + f" | {us[ROUND_VARIANTS[0]] / us['shm, delta']:>13.1f}x | {r['bytes']['gloo, whole Command']:>13}"
              + f" | {r['bytes']['delta']:>11} | {r['pickle_us']:>20.0f} µs")


# ---- part `step`: the whole decode step with the model ----------------------------------------


def _workers(model_dir: Path, tp: int, pages: int):
    from glm53.models import GlmConfig
    from glm53.server.config_parse import parse_config
    from glm53.server.engine.group import LocalWorkers
    from glm53.server.engine.processes import ProcessWorkers
    from glm53.server.engine.worker import rank_specs
    from glm53.support.ports import free_ports

    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": str(model_dir)},
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": PAGE, "num_pages": pages},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2], "tp": tp,
                    **({"dist_init_port": ports[3]} if tp > 1 else {})}],
    })
    inst = cfg.decode[0]
    specs = rank_specs(cfg, inst, str(model_dir), GlmConfig.from_dir(model_dir).num_hidden_layers)
    return LocalWorkers(specs) if tp == 1 else ProcessWorkers(specs, timeout_s=120, port=ports[3])


def part_step(model_dir: Path, batches: list[int], steps: int, pages: int, ctx: int) -> None:
    from glm53.models import GlmConfig, PageAllocator

    vocab = GlmConfig.from_dir(model_dir).vocab_size
    g = torch.Generator().manual_seed(0)
    n_pages = max(batches) * pages + 8
    print(f"decode step of the embedded model ({model_dir.name}), float32, prompts of {ctx} tokens, "
          f"{pages} pages per request, median of {steps} steps (ms); rank 0's forward = its "
          f"RankRuntime.apply; rest = step − forward")
    print(f"{'tp':>3} | {'running':>7} | {'step':>8} | {'rank 0 forward':>14} | {'rest':>8}")
    for tp in (1, 2):
        w = _workers(model_dir, tp, n_pages)
        fwd: list[float] = []
        if tp > 1:  # time rank 0's own share of each step
            inner = w.runtime.apply

            def timed(cmd, _inner=inner):
                t0 = time.perf_counter()
                r = _inner(cmd)
                fwd.append(time.perf_counter() - t0)
                return r

            w.runtime.apply = timed
        try:
            if tp > 1:  # the round with nothing in it: what every scheduler loop pays (`sync`)
                for _ in range(10):
                    w.sync()
                syncs = []
                for _ in range(10 * steps):
                    t0 = time.perf_counter()
                    w.sync()
                    syncs.append(time.perf_counter() - t0)
                print(f"{tp:>3} | {'sync':>7} | {1e3 * statistics.median(syncs):>8.3f} |")
            alloc = PageAllocator(w.num_pages)
            for n in batches:
                tables = [alloc.alloc(pages) for _ in range(n)]
                prompts = [torch.randint(10, vocab - 10, (ctx,), generator=g).tolist() for _ in range(n)]
                w.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
                toks = [p[-1] for p in prompts]
                wall: list[float] = []
                fwd.clear()
                for j in range(steps + 3):
                    t0 = time.perf_counter()
                    logits = w.forward([SeqChunk([t], ctx + j, pg) for t, pg in zip(toks, tables)])
                    dt = time.perf_counter() - t0
                    toks = [int(lg[-1].argmax()) for lg in logits]
                    if j >= 3:
                        wall.append(dt)
                ms = 1e3 * statistics.median(wall)
                if fwd:
                    f = 1e3 * statistics.median(fwd[3:])
                    rest = 1e3 * statistics.median([a - b for a, b in zip(wall, fwd[3:])])
                    print(f"{tp:>3} | {n:>7} | {ms:>8.2f} | {f:>14.2f} | {rest:>8.2f}")
                else:
                    print(f"{tp:>3} | {n:>7} | {ms:>8.2f} | {ms:>14.2f} | {0:>8.2f}")
                alloc.free([p for t in tables for p in t])
        finally:
            w.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=200, help="steps per batch in part round (part step: a tenth)")
    ap.add_argument("--pages-per-request", type=int, default=34)
    ap.add_argument("--ctx", type=int, default=32, help="part step: prompt tokens per request")
    ap.add_argument("--gap-ms", type=float, nargs="+", default=[0.0, 5.0],
                    help="part round: rank 0's busy host work between rounds (the follower waits meanwhile)")
    ap.add_argument("--parts", default="round,step")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    parts = a.parts.split(",")
    if "round" in parts:
        for gap in a.gap_ms:
            part_round(a.batches, a.steps, a.pages_per_request, gap)
    if "step" in parts:
        from glm53.server.embedded_model import ensure_embedded_model

        model_dir = Path(__file__).resolve().parents[1] / "assets" / "tiny-glm5"
        if not (model_dir / "model.safetensors").exists():
            model_dir = ensure_embedded_model(Path(tempfile.mkdtemp(prefix="cp-bench-")))
        part_step(model_dir, a.batches, max(10, a.steps // 10), a.pages_per_request, a.ctx)


if __name__ == "__main__":
    main()

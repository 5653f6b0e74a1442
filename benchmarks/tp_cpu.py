"""Tensor parallelism on CPU: decode-step time of the embedded-size GLM-5 (server/embedded_model.py
MODEL_DIMS, random weights) at tp=2 (two gloo ranks, one thread each) against tp=1 (one thread,
and two threads), the bytes each rank all-reduces and all-gathers per decode step (counted by
`TPGroup.stats`), and the DSA indexer replicated vs split by heads, all in one run.

    PYTHONPATH=. python benchmarks/tp_cpu.py [--ctx 256] [--steps 32] [--dtype float32]

The indexer comparison times one full layer's indexer on rank 0 of two ranks for decode batches
over a paged key cache: "replicated" computes all heads and selects top-k with no communication;
"split" computes half the heads and all-reduces the [tokens, context] fp32 weighted scores before
the top-k (what splitting the heads costs), so the printed ratio is split / replicated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm53.kernels.indexer_logits import indexer_logits
from glm53.kernels.topk import dsa_topk_paged
from glm53.models import ModelRunner, PageAllocator, SeqChunk, TPGroup

PAGE = 16


def write_checkpoint(path: Path) -> dict:
    """The embedded model's config and weight layout (random values, bf16 on disk) without its
    tokenizer: the vocabulary is the embedded model's size (4096 BPE + GLM specials, rounded up to 64)."""
    from glm53.server.embedded_model import EOS_TOKENS, model_config, write_weights

    cfg = model_config(4160, {t: 4096 + i for i, t in enumerate(EOS_TOKENS)})
    (path / "config.json").write_text(json.dumps(cfg))
    write_weights(cfg, path / "model.safetensors")
    return cfg


def _entry(rank: int, world: int, port: int, threads: int, fn, args: tuple) -> None:
    torch.set_num_threads(threads)
    if world == 1:
        fn(TPGroup.single(), *args)
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        fn(TPGroup.from_process_group(), *args)
    finally:
        dist.destroy_process_group()


def run(world: int, threads: int, fn, *args) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, threads, fn, args), nprocs=world, join=True)


# ---- decode steps through ModelRunner ---------------------------------------------------------


def _time_collectives(tp: TPGroup) -> list[float]:
    """Wraps this rank's collectives to add their wall time (waiting for the peer included) to
    the returned one-element accumulator."""
    acc = [0.0]
    for name in ("all_reduce", "all_gather"):
        inner = getattr(tp, name)

        def timed(*a, _inner=inner, **kw):
            t0 = time.perf_counter()
            out = _inner(*a, **kw)
            acc[0] += time.perf_counter() - t0
            return out

        setattr(tp, name, timed)
    return acc


def bench_decode(tp: TPGroup, model_dir: str, out: str, batches: list[int], ctx: int, steps: int, dtype: str) -> None:
    """Median decode-step time of `batches` requests at context `ctx`. On rank 0 of a tp > 1
    group a single-rank runner runs too, its steps interleaved with the tp steps (the peer waits
    in a barrier meanwhile), so that load from other jobs on the machine hits both alike."""
    load = dict(page_size=PAGE, num_pages=2048, progress=False, dtype=getattr(torch, dtype))
    runners = {"tp": ModelRunner.from_dir(model_dir, tp=tp, **load)}
    if tp.size > 1 and tp.rank == 0:
        runners["single"] = ModelRunner.from_dir(model_dir, **load)
    comm = _time_collectives(tp)
    g = torch.Generator().manual_seed(0)  # the same prompts on every rank
    res = {}
    for b in batches:
        prompts = [torch.randint(0, runners["tp"].cfg.vocab_size, (ctx,), generator=g).tolist() for _ in range(b)]
        state = {}
        for key, r in runners.items():
            alloc = PageAllocator(2048)
            pages = [alloc.alloc(r.pages_needed(ctx + steps + 3)) for _ in range(b)]
            for s in range(0, ctx, 256):
                r.forward([SeqChunk(p[s : s + 256], s, pg) for p, pg in zip(prompts, pages)])
            state[key] = (pages, [p[-1] for p in prompts])
        times: dict[str, list[float]] = {key: [] for key in runners}
        comm_times: list[float] = []
        for j in range(steps + 3):  # 3 warm-up steps
            for key, r in runners.items():
                if key == "tp" and tp.size > 1:
                    dist.barrier(group=tp.process_group)
                tp.stats.reset()
                comm[0] = 0.0
                pages, tok = state[key]
                t0 = time.perf_counter()
                logits = r.forward([SeqChunk([t], ctx + j, pg) for t, pg in zip(tok, pages)])
                dt = time.perf_counter() - t0
                # Logits are identical on every rank, so each rank's argmax is rank 0's token.
                state[key] = (pages, [int(lg[-1].argmax()) for lg in logits])
                if j >= 3:
                    times[key].append(dt)
                    if key == "tp":
                        comm_times.append(comm[0])
                        per_step = dict(vars(tp.stats))
        res[b] = {key: 1e3 * statistics.median(t) for key, t in times.items()}
        res[b].update(comm_ms=1e3 * statistics.median(comm_times), comm=per_step)
    if tp.rank == 0:
        Path(out).write_text(json.dumps(res))


# ---- the indexer, replicated vs split by heads ------------------------------------------------


def bench_indexer(tp: TPGroup, cfg: dict, out: str, batches: list[int], contexts: list[int], reps: int) -> None:
    """One full layer's indexer for a decode batch (q_resid and x given), on each rank."""
    torch.manual_seed(1)  # identical weights and cache on every rank
    heads, d = cfg["index_n_heads"], cfg["index_head_dim"]
    wq_b = torch.randn(heads * d, cfg["q_lora_rank"]) / cfg["q_lora_rank"] ** 0.5
    w_proj = torch.randn(heads, cfg["hidden_size"]) / cfg["hidden_size"] ** 0.5
    k = cfg["index_topk"]
    res = {}
    for s in contexts:
        for b in batches:
            n_pages = -(-s // PAGE)
            cache = torch.randn(b * n_pages, PAGE, d)
            table = torch.arange(b * n_pages, dtype=torch.int32).view(b, n_pages)
            lens = torch.full((b,), s, dtype=torch.int32)
            x, q_resid = torch.randn(b, cfg["hidden_size"]), torch.randn(b, cfg["q_lora_rank"])
            times: dict[str, list[float]] = {"replicated": [], "split": []}
            for rep in range(reps + 1):
                for mode in times:  # interleaved, so load from other jobs hits both alike
                    h = heads if mode == "replicated" else heads // tp.size
                    lo = 0 if mode == "replicated" else tp.rank * h
                    wq, wp = wq_b[lo * d : (lo + h) * d], w_proj[lo : lo + h]
                    dist.barrier(group=tp.process_group)
                    t0 = time.perf_counter()
                    q = (q_resid @ wq.T).view(b, h, d)  # RoPE on q[..., :rope] costs the same either way
                    w = (x @ wp.T) * (heads**-0.5 * d**-0.5)
                    logits = indexer_logits(q, w, cache, table, lens, s)
                    if mode == "split":
                        tp.all_reduce(logits)  # masked positions are -inf on every rank and stay -inf
                    slots = dsa_topk_paged(logits, lens, k, table, PAGE)
                    if rep:
                        times[mode].append(time.perf_counter() - t0)
                    assert slots.shape == (b, k)
            row = {mode: 1e3 * statistics.median(t) for mode, t in times.items()}
            row["scores_bytes"] = b * s * 4
            res[f"{s}/{b}"] = row
    # What one collective costs by itself: the hidden-state all-reduce of a decode step.
    for b in batches:
        t = torch.randn(b, cfg["hidden_size"])
        ar_times = []
        for rep in range(51):
            dist.barrier(group=tp.process_group)
            t0 = time.perf_counter()
            tp.all_reduce(t)
            if rep:
                ar_times.append(time.perf_counter() - t0)
        res[f"allreduce/{b}"] = {"ms": 1e3 * statistics.median(ar_times), "bytes": t.numel() * 4}
    if tp.rank == 0:
        Path(out).write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=256, help="prompt length before the decode steps (index_topk is 64)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--indexer-contexts", default="1024,16384")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = write_checkpoint(tmp)
        print(f"embedded-size model: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
              f"{cfg['num_attention_heads']} heads, {cfg['n_routed_experts']} experts, vocab {cfg['vocab_size']}, "
              f"{args.dtype}; decode at context {args.ctx}, median of {args.steps} steps")
        rows = {}
        for world, threads in ((1, 2), (2, 1)):
            out = tmp / "decode.json"
            run(world, threads, bench_decode, str(tmp), str(out), batches, args.ctx, args.steps, args.dtype)
            rows[world] = json.loads(out.read_text())
        table = {
            "tp=1, 1 thread": {b: rows[2][str(b)]["single"] for b in batches},  # interleaved with tp=2
            "tp=2, 1 thread/rank": {b: rows[2][str(b)]["tp"] for b in batches},
            "tp=1, 2 threads": {b: rows[1][str(b)]["tp"] for b in batches},  # separate run
        }
        base = table["tp=1, 1 thread"]
        print(f"{'':22s}" + "".join(f"{'batch ' + str(b) + ' step':>18s}{'tp=1/1t ÷ this':>16s}" for b in batches))
        for name, r in table.items():
            print(f"{name:22s}" + "".join(f"{r[b]:15.2f} ms{base[b] / r[b]:15.2f}x" for b in batches))
        print("per decode step, per rank (tp=2):")
        for b in batches:
            r = rows[2][str(b)]
            c = r["comm"]
            print(f"  batch {b:3d}: {r['comm_ms']:.2f} ms in collectives; "
                  f"all-reduce {c['all_reduce_calls']} calls, {c['all_reduce_bytes']} B; "
                  f"all-gather {c['all_gather_calls']} call, {c['all_gather_bytes']} B sent "
                  f"({2 * c['all_gather_bytes']} B gathered)")

        out = tmp / "indexer.json"
        contexts = [int(x) for x in args.indexer_contexts.split(",")]
        run(2, 1, bench_indexer, cfg, str(out), batches, contexts, 15)
        print(f"DSA indexer, one full layer, rank 0 of tp=2 ({cfg['index_n_heads']} heads of {cfg['index_head_dim']}, "
              "decode batch): replicated = all heads, no communication; split = half the heads + all-reduce of the scores")
        for key, r in json.loads(out.read_text()).items():
            s, b = key.split("/")
            if s == "allreduce":
                print(f"  gloo all-reduce alone, batch {b:>3s} hidden state ({r['bytes']} B): {r['ms']:.3f} ms")
                continue
            print(f"  context {s:>6s} batch {b:>3s}: replicated {r['replicated']:8.3f} ms  split {r['split']:8.3f} ms "
                  f"(split/replicated {r['split'] / r['replicated']:.2f}x; all-reduce {r['scores_bytes']} B)")


if __name__ == "__main__":
    main()

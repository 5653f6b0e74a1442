"""Expert parallelism: tp = W ranks with ep = 1 (every rank holds every expert at 1/W of its width;
the layer's one all-reduce) against ep > 1 (each group of W / ep ranks a range of the experts; two
all-to-alls more per MoE layer). All variants live in the same rank processes and run call by call
interleaved, so load from other jobs hits them alike. On CPU: gloo, one thread per rank, fp32; on
CUDA (`--device cuda`): NCCL, one GPU per rank, bf16.

1. One MoE layer (router, routed experts, shared expert, the all-reduce; with ep > 1 the token
   exchange), at decode and prefill token counts, for the shapes named by `--shapes`: `embedded`
   (the embedded model's: 8 experts, top-2, hidden 256, width 128), `wide` (64 experts, top-8,
   hidden 1024, width 512), `glm5` (GLM-5's: 256 experts, top-8, hidden 6144, width 2048; for
   GPUs). The expert weights are drawn per expert, so every ep holds the same experts and each
   variant's output is compared with ep = 1's (`max |diff|` relative to max |out|, printed).
2. `--decode`: the decode step of the embedded-size model (server/embedded_model.py MODEL_DIMS,
   random weights) at context `--ctx`.

    PYTHONPATH=. python benchmarks/ep.py                           # CPU: tp 2, ep 1 vs 2, both shapes, decode
    PYTHONPATH=. python benchmarks/ep.py --device cuda --world 8 --eps 1,2,8 --shapes glm5 \\
        --batches 1,64,512,4096 --no-decode                        # 8 GPUs: GLM-5's experts over NCCL

Prints per token count each variant's median time, its ratio to ep = 1 and the time spent in
collectives (rank 0's wall time inside them, waiting for peers included; on CUDA after a
synchronize, so it is the time to the collective's completion).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
import zlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm53.models import GlmConfig, ModelRunner, PageAllocator, SeqChunk, TPGroup
from glm53.models.moe import MoE
from glm53.models.sharding import shard_of
from glm53.models.weights import load_model

PAGE = 16
WIDE = {"n_routed_experts": 64, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "hidden_size": 1024,
        "moe_intermediate_size": 512}


def embedded_config() -> dict:
    """The embedded model's config.json (its vocabulary size without the tokenizer: 4096 BPE +
    GLM specials, rounded up to 64)."""
    from glm53.server.embedded_model import EOS_TOKENS, model_config

    return model_config(4160, {t: 4096 + i for i, t in enumerate(EOS_TOKENS)})


def shape_config(name: str) -> dict:
    if name == "glm5":
        from glm53.support.glm5_slice import slice_config

        return slice_config(layers=4, experts=256, vocab=4160)
    return {**embedded_config(), **(WIDE if name == "wide" else {})}


def _entry(rank: int, world: int, port: int, device: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        fn(TPGroup.from_process_group(), *args)
    finally:
        dist.destroy_process_group()


def run(world: int, device: str, fn, *args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, device, fn, args), nprocs=world, join=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collectives(tp: TPGroup, device: torch.device) -> list[float]:
    """Wraps the group's collectives so that their wall time adds up in the returned accumulator."""
    acc = [0.0]
    for name in ("all_reduce", "all_gather", "all_to_all"):
        inner = getattr(tp, name)

        def timed(*a, _inner=inner, **kw):
            _sync(device)
            t0 = time.perf_counter()
            out = _inner(*a, **kw)
            _sync(device)
            acc[0] += time.perf_counter() - t0
            return out

        setattr(tp, name, timed)
    return acc


def fill_moe_(moe: MoE, device: torch.device) -> None:
    """Random weights, the same for every ep: each expert's checkpoint tensor drawn from a seed of
    its own (then this rank's part of it taken by the stack's shard rule), every other parameter
    from a seed of its name (replicated ones, the router above all, equal on every rank)."""
    g = torch.Generator(device=device)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            rule = shard_of(p)
            if rule.experts is None:
                g.manual_seed(zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g, device=device) * p.shape[-1] ** -0.5)
                continue
            full = rule.full_shape(tuple(p.shape[1:]))
            idx = rule.index(full)
            for row, e in enumerate(rule.experts):
                g.manual_seed(zlib.crc32(f"{name}.{e}".encode()))
                w = torch.randn(full, generator=g, device=device) * full[-1] ** -0.5
                p[row].copy_(w if idx is None else w[idx])


def bench_moe(tp: TPGroup, dims: dict, eps: list[int], device: str, out: str, batches: list[int], reps: int) -> None:
    dev = torch.device(f"cuda:{tp.rank}" if device == "cuda" else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = GlmConfig.from_dict(dims)
    comm = time_collectives(tp, dev)
    layers = {}
    for ep in eps:
        with torch.device(dev):
            layers[ep] = MoE(cfg, dtype, tp, ep)
        fill_moe_(layers[ep], dev)
    res = {}
    for b in batches:
        x = torch.randn(b, cfg.hidden_size, generator=torch.Generator().manual_seed(b)).to(dev, dtype)  # same everywhere
        times: dict[int, list[float]] = {ep: [] for ep in eps}
        comm_times: dict[int, list[float]] = {ep: [] for ep in eps}
        outs = {}
        for rep in range(reps + 3):  # 3 warm-up repetitions
            for ep in eps:
                dist.barrier(group=tp.process_group)
                _sync(dev)
                comm[0] = 0.0
                t0 = time.perf_counter()
                with torch.inference_mode():
                    outs[ep] = layers[ep](x)
                _sync(dev)
                if rep >= 3:
                    times[ep].append(time.perf_counter() - t0)
                    comm_times[ep].append(comm[0])
        ref = outs[eps[0]].float()
        res[b] = {ep: {"ms": 1e3 * statistics.median(times[ep]), "comm_ms": 1e3 * statistics.median(comm_times[ep]),
                       "rel_diff": float((outs[ep].float() - ref).abs().max() / ref.abs().max())} for ep in eps}
    if tp.rank == 0:
        Path(out).write_text(json.dumps(res))


def bench_decode(tp: TPGroup, model_dir: str, eps: list[int], out: str, batches: list[int], ctx: int,
                 steps: int) -> None:
    runners = {ep: ModelRunner(load_model(model_dir, dtype=torch.float32, tp=tp, ep=ep, progress=False),
                               num_pages=2048, page_size=PAGE) for ep in eps}
    comm = time_collectives(tp, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)  # the same prompts on every rank
    res = {}
    for b in batches:
        prompts = [torch.randint(0, runners[eps[0]].cfg.vocab_size, (ctx,), generator=g).tolist() for _ in range(b)]
        state = {}
        for ep, r in runners.items():
            alloc = PageAllocator(2048)
            pages = [alloc.alloc(r.pages_needed(ctx + steps + 3)) for _ in range(b)]
            for s in range(0, ctx, 256):
                r.forward([SeqChunk(p[s : s + 256], s, pg) for p, pg in zip(prompts, pages)])
            state[ep] = (pages, [p[-1] for p in prompts])
        times: dict[int, list[float]] = {ep: [] for ep in eps}
        comm_times: dict[int, list[float]] = {ep: [] for ep in eps}
        for j in range(steps + 3):  # 3 warm-up steps
            for ep, r in runners.items():
                dist.barrier(group=tp.process_group)
                comm[0] = 0.0
                pages, tok = state[ep]
                t0 = time.perf_counter()
                logits = r.forward([SeqChunk([t], ctx + j, pg) for t, pg in zip(tok, pages)])
                dt = time.perf_counter() - t0
                # Logits are identical on every rank, so each rank's argmax is rank 0's token.
                state[ep] = (pages, [int(lg[-1].argmax()) for lg in logits])
                if j >= 3:
                    times[ep].append(dt)
                    comm_times[ep].append(comm[0])
        res[b] = {ep: {"ms": 1e3 * statistics.median(times[ep]), "comm_ms": 1e3 * statistics.median(comm_times[ep])}
                  for ep in eps}
    if tp.rank == 0:
        Path(out).write_text(json.dumps(res))


def report(title: str, rows: dict, eps: list[int]) -> None:
    print(title)
    for b, r in rows.items():
        base = r[str(eps[0])]["ms"]
        cells = []
        for ep in eps:
            c = r[str(ep)]
            diff = f", diff {c['rel_diff']:.1e}" if "rel_diff" in c and ep != eps[0] else ""
            cells.append(f"ep {ep}: {c['ms']:8.2f} ms ({c['ms'] / base:4.2f}x; collectives {c['comm_ms']:7.2f}{diff})")
        print(f"  tokens {b:>5s}  " + "   ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--world", type=int, default=2, help="tp: ranks of the group")
    ap.add_argument("--eps", default="1,2", help="ep values to compare (the first is the baseline)")
    ap.add_argument("--shapes", default="embedded,wide", help="MoE layer shapes: embedded, wide, glm5")
    ap.add_argument("--batches", default="1,16,64", help="token counts")
    ap.add_argument("--reps", type=int, default=50, help="MoE layer calls timed per token count and shape")
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the embedded-size model's decode step (CPU)")
    ap.add_argument("--ctx", type=int, default=256, help="context of the decode steps (index_topk is 64)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    eps = [int(x) for x in args.eps.split(",")]
    dtype = "bf16" if args.device == "cuda" else "fp32"
    print(f"tp = {args.world} ({args.device}, {'NCCL' if args.device == 'cuda' else 'gloo, one thread a rank'}), "
          f"{dtype}; ep {eps}; medians; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.shapes.split(","):
            shape = shape_config(name)
            out = tmp / f"moe-{name}.json"
            run(args.world, args.device, bench_moe, shape, eps, args.device, str(out), batches, args.reps)
            report(f"MoE layer, {name} shapes ({shape['n_routed_experts']} experts, top-{shape['num_experts_per_tok']}, "
                   f"hidden {shape['hidden_size']}, width {shape['moe_intermediate_size']}), median of {args.reps}:",
                   json.loads(out.read_text()), eps)
        if args.decode:
            from glm53.server.embedded_model import write_weights

            cfg = embedded_config()
            (tmp / "config.json").write_text(json.dumps(cfg))
            write_weights(cfg, tmp / "model.safetensors")
            out = tmp / "decode.json"
            run(args.world, "cpu", bench_decode, str(tmp), eps, str(out), batches, args.ctx, args.steps)
            report(f"decode step, embedded-size model ({cfg['num_hidden_layers']} layers, "
                   f"{cfg['num_hidden_layers'] - cfg['first_k_dense_replace']} MoE), context {args.ctx}, median of "
                   f"{args.steps}:", json.loads(out.read_text()), eps)


if __name__ == "__main__":
    main()

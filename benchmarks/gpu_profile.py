"""Where a GPU step's time goes, and prefill against the matmul roofline (made for the device tool).

1. `decode`: the slice's decode step (CUDA graphs, as served) at the given batch sizes with
   4K-token contexts: wall time per step, the step's graph replayed back to back (its GPU time
   without host gaps: the figure to compare trees by), and under `torch.profiler` the GPU kernel
   time per step and the kernels that take it, grouped by name (kernels inside graph replays are
   recorded too).
2. `prefill`: one 4K-token prompt prefilled in one chunk: time, the model's real FLOPs for it
   (every projection it runs, experts by top-k, sparse MLA over the selected rows, the indexer
   over the causal context) and the bf16 matmul throughput measured in the same run on the
   prefill's own large GEMM shapes; prints the fraction of it the prefill reaches, and its kernels.

    PYTHONPATH=. python3 benchmarks/gpu_profile.py --out DIR [--phases decode,prefill] [--slice DIR] [--sizes 1 64]

The slice is written as benchmarks/gpu_e2e.py writes it (`glm53.support.glm5_slice.ensure_slice`).
A JSON report goes to DIR/gpu_profile.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from glm53.support.glm5_slice import ensure_slice
from glm53.support.kernel_profile import kernel_table, launch_counts, print_table, profile, replay_us


# -- decode ------------------------------------------------------------------------------------
def graph_replay_us(runner, chunks, replays: int = 50, runs: int = 5) -> float:
    """The decode graph that holds `chunks`, replayed `replays` times back to back between two
    events, median of `runs`: the step's GPU time with no host work between steps. The wall time
    includes the host's; the profiler's kernel sum counts a kernel launched early (programmatic
    dependent launch) from its launch, its wait included. (The replays rewrite one step's cache
    rows with the same values.)"""
    graph = runner.graphs.graphs[runner.graphs.bucket(chunks)][0]
    return statistics.median(replay_us(graph, replays) for _ in range(runs))


def decode_profile(model_dir: Path, sizes: list[int], ctx: int, steps: int, top: int,
                   fp8: bool = False) -> list[dict]:
    from glm53.models import ModelRunner, SeqChunk
    from glm53.models.graph import GraphConfig

    base = ModelRunner.from_dir(model_dir, page_size=64, num_pages=1, device="cuda", progress=False, fp8=fp8)
    need = -(-(ctx + 4 * steps + 64) // 64)
    runner = ModelRunner(base.model, num_pages=need * max(sizes), page_size=64, device="cuda",
                         graphs=GraphConfig(max_bs=max(sizes), max_context=need * 64))
    for _, pool in runner.pools:
        pool.tensor.normal_()
    report = []
    for bs in sizes:
        state = {"it": 0, "toks": [1] * bs}

        def step():
            it = state["it"]
            chunks = [SeqChunk([state["toks"][i]], ctx + it, list(range(i * need, (i + 1) * need))) for i in range(bs)]
            logits = runner.forward(chunks)
            state["toks"] = torch.cat(logits).argmax(-1).tolist()
            state["it"] = it + 1

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        wall = statistics.median(times) * 1e3
        graph_us = graph_replay_us(runner, [SeqChunk([1], ctx + state["it"], list(range(i * need, (i + 1) * need)))
                                            for i in range(bs)])
        print(f"decode bs {bs}: the step's graph replayed back to back {graph_us:.1f} us/step", flush=True)
        prof = profile(step, steps)
        gpu_us, rows = kernel_table(prof, steps, top)
        print_table(f"decode bs {bs}: wall {wall:.2f} ms/step", gpu_us, rows)
        counts = launch_counts(prof, steps)
        print(f"decode bs {bs}: {counts}", flush=True)
        report.append({"bs": bs, "wall_ms": wall, "graph_us": graph_us, "gpu_us": gpu_us, "kernels": rows, **counts})
    return report


# -- prefill -----------------------------------------------------------------------------------
def prefill_flops(cfg, model, n: int) -> dict:
    """FLOPs of prefilling n tokens from position 0 (one logit row)."""
    from glm53.models.config import FULL

    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    dense = experts = head = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.dim() < 2:
            continue
        if ".experts." in name:
            experts += 2 * n * k * p.numel() // e
        elif "lm_head" in name:
            head += 2 * p.numel()
        else:
            dense += 2 * n * p.numel()  # kv_b_proj too: absorbed into q and o, same count
    r, rope, h = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    sel = sum(min(t + 1, cfg.index_topk) for t in range(n))  # rows each token's top-k holds
    attn = cfg.num_hidden_layers * h * sel * (2 * (r + rope) + 2 * r)
    causal = n * (n + 1) // 2
    full = sum(1 for t in cfg.indexer_types if t == FULL)
    indexer = full * causal * cfg.index_n_heads * cfg.index_head_dim * 2
    parts = {"dense": dense, "experts": experts, "head": head, "sparse_mla": attn, "indexer": indexer}
    parts["total"] = sum(parts.values())
    return parts


def matmul_tflops(shapes: list[tuple[int, int, int]], reps: int = 20) -> dict:
    """bf16 torch.matmul throughput (TFLOP/s) for [m, k] @ [k, n] shapes."""
    out = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            a @ b
        t.record()
        torch.cuda.synchronize()
        out[f"{m}x{k}x{n}"] = 2 * m * k * n * reps / (s.elapsed_time(t) / 1e3) / 1e12
    return out


def prefill_profile(model_dir: Path, n: int, reps: int, top: int) -> dict:
    from glm53.models import ModelRunner, SeqChunk

    pages = -(-n // 64) + 1
    runner = ModelRunner.from_dir(model_dir, page_size=64, num_pages=pages, device="cuda", progress=False)
    cfg = runner.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    def run():
        runner.forward([SeqChunk(ids, 0, list(range(pages)))])

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    flops = prefill_flops(cfg, runner.model, n)
    h, i, q = cfg.hidden_size, cfg.moe_intermediate_size, cfg.q_lora_rank
    mm = matmul_tflops([(n, h, q), (n, q, cfg.num_attention_heads * cfg.qk_head_dim), (n * cfg.num_experts_per_tok // max(cfg.n_routed_experts, 1), h, 2 * i), (8192, 8192, 8192)])
    peak = max(mm.values())
    achieved = flops["total"] / sec / 1e12
    print(f"prefill {n} tokens: {sec * 1e3:.1f} ms, {flops['total'] / 1e12:.2f} TFLOP "
          f"({', '.join(f'{k} {v / 1e12:.2f}' for k, v in flops.items() if k != 'total')}) -> {achieved:.0f} TFLOP/s; "
          f"bf16 matmul {', '.join(f'{k}: {v:.0f}' for k, v in mm.items())} TFLOP/s -> {achieved / peak:.0%} of the best",
          flush=True)
    prof = profile(run, 2)
    gpu_us, rows = kernel_table(prof, 2, top)
    print_table(f"prefill {n}", gpu_us, rows)
    return {"tokens": n, "ms": sec * 1e3, "flops": flops, "tflops": achieved, "matmul_tflops": mm,
            "fraction": achieved / peak, "gpu_us": gpu_us, "kernels": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="decode,prefill")
    ap.add_argument("--slice", default="/tmp/glm5-slice")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--fp8", action="store_true", help="the slice in the GLM-5-FP8 layout, its weights kept FP8 "
                    "(issue 29); default slice dir /tmp/glm5-slice-fp8")
    ap.add_argument("--w8a16-max-m", type=int, default=None,
                    help="FP8 linears: w8a16 up to this many rows (fp8_gemm.W8A16_MAX_M; default the dispatcher's)")
    ap.add_argument("--moe-w8a16-max-tokens", type=int, default=None,
                    help="FP8 experts: w8a16 up to this many tokens (moe_fp8.MOE_W8A16_MAX_TOKENS; default the dispatcher's)")
    a = ap.parse_args()
    if a.w8a16_max_m is not None:
        from glm53.kernels import fp8_gemm

        fp8_gemm.W8A16_MAX_M = a.w8a16_max_m
    if a.moe_w8a16_max_tokens is not None:
        from glm53.kernels import moe_fp8

        moe_fp8.MOE_W8A16_MAX_TOKENS = a.moe_w8a16_max_tokens
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    slice_dir = ensure_slice(Path(a.slice + "-fp8" if a.fp8 and a.slice == "/tmp/glm5-slice" else a.slice), fp8=a.fp8)
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(a)}
    if "decode" in a.phases:
        report["decode"] = decode_profile(slice_dir, a.sizes, a.context, a.steps, a.top, a.fp8)
        torch.cuda.empty_cache()
    if "prefill" in a.phases:
        report["prefill"] = prefill_profile(slice_dir, a.context, 3, a.top)
    (out / "gpu_profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

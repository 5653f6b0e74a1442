"""What cross-layer index sharing buys a decode step (issue 33, item 5), on one GPU.

The same GLM-5-width model (random weights, built on the GPU: no checkpoint) with its indexer
schedule set by `index_topk_freq` 1, 2 and 4 (`index_skip_topk_offset` 1, so layer i runs its own
indexer iff i % freq == 0: with 8 layers 8, 4 and 2 full layers); nothing else changes. Per
(freq, context, batch): the graphed decode step (`ModelRunner.forward` replayed from its CUDA
graph, argmax and the tokens back, as the serving loop runs it), median over `--iters` steps,
and the share of the step's GPU kernel time spent in the indexer (the Triton kernels of
`indexer_logits_triton` and `topk_triton`, by name under the profiler).

    PYTHONPATH=. python3 benchmarks/index_sharing.py [--layers 8] [--experts 16] [--contexts 4096 32768 131072]
        [--batch 1 64] [--freqs 1 2 4] [--iters 30] [--json out.json]
    PYTHONPATH=. python3 benchmarks/index_sharing.py --smoke   # CPU: tiny widths, checks that it runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from glm53.models import GlmConfig, SeqChunk
from glm53.models.graph import GraphConfig
from glm53.models.layers import materialize_
from glm53.models.model import GlmForCausalLM
from glm53.models.runner import ModelRunner
from glm53.support.glm5_slice import slice_config



def indexer_kernel_names() -> tuple[str, ...]:
    """The Triton kernels of the indexer's logits and its top-k (by their function names)."""
    from triton.runtime.jit import JITFunction

    from glm53.kernels import indexer_logits_triton, topk_triton

    return tuple(name for mod in (indexer_logits_triton, topk_triton) for name, f in vars(mod).items()
                 if isinstance(f, JITFunction) and name.endswith("_kernel"))


def random_model(cfg: GlmConfig, device: str, seed: int) -> GlmForCausalLM:
    """The model with fresh random weights on `device` (norm weights 1, biases 0)."""
    with torch.device("meta"):
        model = GlmForCausalLM(cfg, dtype=torch.bfloat16)
    materialize_(model, device)
    model.init_buffers(device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.normal_(0.0, fan_in**-0.5, generator=g)
    return model


def step_ms(runner: ModelRunner, bs: int, ctx: int, pages_per: int, iters: int) -> float:
    toks = [1] * bs
    times = []
    for it in range(iters):
        chunks = [SeqChunk([toks[i]], ctx + it, list(range(i * pages_per, (i + 1) * pages_per))) for i in range(bs)]
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        toks = torch.cat(runner.forward(chunks)).argmax(-1).tolist()
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1e3


def indexer_share(runner: ModelRunner, bs: int, ctx: int, pages_per: int) -> float:
    """Share of one step's GPU kernel time in kernels whose names say indexer or top-k."""
    from torch.profiler import ProfilerActivity, profile

    chunks = [SeqChunk([1], ctx, list(range(i * pages_per, (i + 1) * pages_per))) for i in range(bs)]
    runner.forward(chunks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(chunks)
        torch.cuda.synchronize()
    names = indexer_kernel_names()
    total = part = 0.0
    for e in prof.key_averages():
        t = e.device_time_total
        total += t
        if any(k in e.key for k in names):
            part += t
    return part / total if total else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--freqs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU, eager: checks that it runs")
    a = ap.parse_args()
    device = "cpu" if a.smoke else "cuda"
    widths = {"index_skip_topk_offset": 1}
    if a.smoke:
        widths.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=2,
                      num_key_value_heads=2, index_n_heads=2, index_head_dim=16, index_topk=32)
        a.contexts, a.batch, a.iters = [64], [1, 2], 5
    page = 64
    rows = []
    for freq in a.freqs:
        cfg = GlmConfig.from_dict(slice_config(a.layers, a.experts, 4160, widths={**widths, "index_topk_freq": freq}))
        full = len(cfg.full_layers)
        model = random_model(cfg, device, seed=0)
        pages_per = -(-(max(a.contexts) + a.iters + 1) // page)
        graphs = None if a.smoke else GraphConfig(max_bs=max(a.batch), max_context=pages_per * page)
        runner = ModelRunner(model, num_pages=pages_per * max(a.batch), page_size=page, device=device, graphs=graphs)
        for _, pool in runner.pools:  # random KV: real indexer scores, no all-tie top-k
            pool.tensor.normal_()
        for ctx in a.contexts:
            for bs in a.batch:
                ms = step_ms(runner, bs, ctx, pages_per, a.iters)
                share = indexer_share(runner, bs, ctx, pages_per) if device == "cuda" else float("nan")
                rows.append(dict(freq=freq, full_layers=full, layers=a.layers, context=ctx, batch=bs, step_ms=ms,
                                 indexer_share=share))
                print(f"freq {freq} ({full}/{a.layers} full)  ctx {ctx:6d}  bs {bs:2d}: step {ms:7.3f} ms, "
                      f"indexer {share:.0%} of GPU kernel time", flush=True)
        del runner, model
        gc.collect()  # the graphs and the runner refer to each other: free the pools before the next model
        if device == "cuda":
            torch.cuda.empty_cache()
    base = {(r["context"], r["batch"]): r["step_ms"] for r in rows if r["freq"] == a.freqs[0]}
    print(f"\nspeed-up over freq {a.freqs[0]} (same context and batch):")
    for r in rows:
        r["speedup"] = base[(r["context"], r["batch"])] / r["step_ms"]
        print(f"  freq {r['freq']} ctx {r['context']:6d} bs {r['batch']:2d}: x{r['speedup']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""GPU end to end on one GPU, in one run (made for the device tool):

1. `floor`: the device copy bandwidth, measured now, and per batch size the bytes a decode step
   must read (the weights it touches + the KV its attention reads): the HBM floor of a step.
2. `model`: the slice's decode step alone (`ModelRunner.forward` + argmax + the token copy back,
   as the serving loop does it) at batch 1 and 64 with 4K-token contexts, CUDA graphs on and off.
3. `serve`: the slice served by one-GPU PD (`glm53-serve up`, prefill and decode sharing GPU 0
   by `mem_fraction_static`), `benchmarks/serving.py`'s sweep at concurrency 1 and 64, graphs on
   and off; ITL p50 printed beside the floor.
4. `exact`: the embedded tiny model served the same way in fp32, greedy outputs of a concurrent
   batch of prompts against the CPU reference (`glm53-serve generate` on CPU).
5. `fp8` (with --fp8: the slice in the GLM-5-FP8 layout, served with its FP8 weights kept FP8, the
   floor counting their real bytes): GPU memory after loading it FP8 and dequantized to bf16; a
   4K-token prefill chunk FP8 against bf16; greedy top-1 agreement of the FP8 kernels with the
   dequantized (bf16) reference, teacher-forced over every prompt position (prefill kernels) and
   over decode steps that follow the reference's greedy tokens (decode kernels).

    PYTHONPATH=. python3 benchmarks/gpu_e2e.py --out DIR [--phases floor,model,serve,exact] [--slice DIR]

The router needs fastapi, starlette, pydantic (+ pydantic_core, annotated-types,
typing-inspection) and uvicorn, which the device image lacks: carry them as wheels.

The slice (tools/make_slice.py: GLM-5 widths, 4 layers, 16 experts) is written to --slice unless
it exists. A JSON report goes to DIR/gpu_e2e.json; servers' logs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from glm53.support.corpus import package_head_prompts
from glm53.support.glm5_slice import ensure_slice
from glm53.support.gpu_server import Server, cluster_config
from glm53.support.greedy import PROMPT_LENS, cpu_reference, served_greedy
from glm53.support.hbm_floor import copy_bandwidth, step_bytes
from glm53.support.oracle import quantised_embedded_model
from glm53.support.serving_sweep import sweep_point


# -- the model's step alone --------------------------------------------------------------------
def model_steps(model_dir: Path, sizes: list[int], ctx: int, iters: int, fp8: bool = False) -> list[dict]:
    from glm53.models import ModelRunner, SeqChunk
    from glm53.models.graph import GraphConfig

    base = ModelRunner.from_dir(model_dir, page_size=64, num_pages=1, device="cuda", progress=False, fp8=fp8)
    need = -(-(ctx + iters + 64) // 64)
    pages = need * max(sizes)
    t0 = time.perf_counter()
    runner = ModelRunner(base.model, num_pages=pages, page_size=64, device="cuda",
                         graphs=GraphConfig(max_bs=max(sizes), max_context=need * 64))
    capture_s = time.perf_counter() - t0
    for _, pool in runner.pools:  # random KV: realistic indexer scores (no all-tie top-k)
        pool.tensor.normal_()
    graphs = runner.graphs
    rows = []
    for bs in sizes:
        for mode in ("graph", "eager"):
            runner.graphs = graphs if mode == "graph" else None
            times = []
            toks = [1] * bs
            for it in range(iters):
                chunks = [SeqChunk([toks[i]], ctx + it, list(range(i * need, (i + 1) * need))) for i in range(bs)]
                torch.cuda.synchronize()
                t = time.perf_counter()
                logits = runner.forward(chunks)
                toks = torch.cat(logits).argmax(-1).tolist()
                times.append(time.perf_counter() - t)
            ms = statistics.median(times[3:]) * 1e3
            rows.append({"bs": bs, "mode": mode, "ms": ms})
            print(f"model step bs {bs:3d} {mode:5s}: {ms:7.2f} ms", flush=True)
    runner.graphs = graphs
    return [{"capture_s": capture_s, "graphs": len(graphs.graphs)}] + rows


# -- serving (the deployment: glm53.support.gpu_server) ----------------------------------------
def serve_sweep(model_dir: Path, out: Path, graphs: bool, conc: list[int], n_req: int, in_len: int,
                out_len: int, long_out: int = 0, placement: dict | None = None, dtype: str = "bfloat16") -> list[dict]:
    """The sweep; with `long_out`, one more point at the highest concurrency with that many
    output tokens, so that most of its decode steps run after every prefill is done. `placement`:
    per role the instance keys that place it (devices, tp); default both on GPU 0."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    placement = placement or {}
    where = "".join(f"-{role[0]}{'.'.join(map(str, p['devices']))}" + (f"-tp{p['tp']}" if p.get("tp", 1) > 1 else "")
                    + (f"-colocated{p['colocate_sms']}" if p.get("colocate") else "") for role, p in placement.items())
    tag = f"serve-graphs-{'on' if graphs else 'off'}{where}"
    print(f"{tag}:", flush=True)
    context = in_len + max(out_len, long_out) + 64
    cfg = cluster_config(str(model_dir), dtype, graphs, [0] * 5, context)
    for role, p in placement.items():
        cfg[role][0].update(p)
    with Server(cfg, out, tag) as s:
        asyncio.run(sweep_point(s.url, "m", 1, 2, in_len, out_len, vocab, 99))  # warm-up
        rows = []
        points = [(c, out_len) for c in conc] + ([(max(conc), long_out)] if long_out else [])
        for c, n_out in points:
            r = asyncio.run(sweep_point(s.url, "m", c, max(n_req, c), in_len, n_out, vocab, c))
            r["graphs"] = graphs
            r["output_len"] = n_out
            r["startup_s"] = s.startup_s
            r["placement"] = placement
            rows.append(r)
            print(f"  conc {c}, {n_out} out: {r['ok']}/{r['n']} ok, {r['out_tok_s']:.0f} tok/s, TTFT p50 "
                  f"{r['ttft_p50'] * 1e3:.0f} ms, ITL p50 {r['itl_p50'] * 1e3:.2f} ms, p99 {r['itl_p99'] * 1e3:.2f} ms; "
                  f"after every prefill: ITL p50 {r['itl_after_prefills_p50'] * 1e3:.2f} ms over "
                  f"{r['itl_after_prefills_n']} intervals; ITL p90 {r.get('itl_p90', float('nan')) * 1e3:.2f} ms", flush=True)
    return rows


# -- exactness (the outputs compared: glm53.support.greedy) ------------------------------------
def exact_check(out: Path, modes: tuple[bool, ...] = (True, False), new: int = 24, colocate_sms: int = 0) -> dict:
    from glm53.server.embedded_model import ensure_embedded_model

    model = ensure_embedded_model()
    prompts = [[(i * 37 + 11 * n) % 4000 + 10 for i in range(n)] for n in PROMPT_LENS]
    cpu = cpu_reference(model, prompts, new)

    report = {}
    for graphs in modes:
        tag = f"exact-graphs-{'on' if graphs else 'off'}" + (f"-colocated{colocate_sms}" if colocate_sms else "")
        cfg = cluster_config(str(model), "float32", graphs, [0] * 5, 1024)
        if colocate_sms:
            cfg["prefill"][0].update(colocate="d0", colocate_sms=colocate_sms)
        with Server(cfg, out, tag) as s:
            gpu = asyncio.run(served_greedy(s.url, prompts, new))
        same = sum(a == b for a, b in zip(cpu, gpu))
        report[tag] = {"equal": same, "of": len(prompts)}
        print(f"{tag}: {same}/{len(prompts)} greedy outputs equal to the CPU reference", flush=True)
    return report


# -- FP8 weights against their dequantized reference -------------------------------------------
def fp8_checks(model_dir: Path, prompts: list[list[int]], steps: int, prefill_len: int = 4096,
               ref_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Memory, a `prefill_len`-token prefill and greedy top-1 agreement with the same checkpoint
    dequantized at load to `ref_dtype` (fp32 where the kernels take it; at GLM-5's latent width the
    sparse-MLA kernel's fp32 tiles do not fit shared memory, so the slice's reference is bf16) of:
    the checkpoint dequantized to bf16, the FP8 kernels as dispatched, and the FP8 kernels with
    every GEMM and MoE in the weight-only (w8a16) variant (what quantizing activations costs).
    Agreement: every prompt position teacher-forced, then `steps` decode steps fed the reference's
    greedy tokens; also by quartile of the reference's top-1 margin (in logit standard deviations)."""
    from glm53.kernels import fp8_gemm, moe_fp8
    from glm53.models import ModelRunner, SeqChunk

    n_seq, prompt_len = len(prompts), len(prompts[0])
    report: dict = {"model": str(model_dir)}
    pages_per = -(-(max(prompt_len + steps, prefill_len) + 1) // 64)
    pages = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(n_seq)]

    def load(fp8: bool, dtype: torch.dtype):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        r = ModelRunner.from_dir(model_dir, page_size=64, num_pages=pages_per * n_seq, device="cuda",
                                 dtype=dtype, fp8=fp8, progress=False)
        weights = sum(t.numel() * t.element_size() for t in [*r.model.parameters(), *r.model.buffers()])
        return r, weights, torch.cuda.memory_allocated() - before

    def prefill_ms(r) -> float:
        toks = torch.randint(10, r.model.cfg.vocab_size, (prefill_len,)).tolist()
        chunk = [SeqChunk(toks, 0, list(range(pages_per)))]
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t = time.perf_counter()
            r.forward(chunk)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:]) * 1e3

    def run(r, follow):
        """(logits rows [positions, V] of the prompts then of the decode steps, the tokens fed per sequence)."""
        out = r.forward([SeqChunk(p, 0, pg, all_logits=True) for p, pg in zip(prompts, pages)])
        rows = [torch.cat(out).float()]
        toks = [o[-1].argmax(-1).item() for o in out]
        fed = []
        for t in range(steps):
            feed = [f[t] for f in follow] if follow is not None else toks
            fed.append(feed)
            logits = r.forward([SeqChunk([feed[i]], prompt_len + t, pages[i]) for i in range(n_seq)])
            rows.append(torch.cat(logits).float())
            toks = rows[-1].argmax(-1).tolist()
        return torch.cat(rows), [[fed[t][i] for t in range(steps)] for i in range(n_seq)]

    ref_rows = follow = None
    limits = (fp8_gemm.W8A16_MAX_M, moe_fp8.MOE_W8A16_MAX_TOKENS)
    variants = (("reference", False, ref_dtype), ("bf16_dequantized", False, torch.bfloat16),
                ("fp8", True, torch.bfloat16), ("fp8_weight_only", True, torch.bfloat16))
    for name, fp8, dtype in variants:
        if name == "bf16_dequantized" and ref_dtype == torch.bfloat16:
            continue
        weight_only = name == "fp8_weight_only"
        fp8_gemm.W8A16_MAX_M, moe_fp8.MOE_W8A16_MAX_TOKENS = (1 << 30, 1 << 30) if weight_only else limits
        r, weights, mem = load(fp8, dtype)
        rows, fed = run(r, follow)
        report[name] = {"weight_bytes": weights, "allocated_after_load": mem,
                        "prefill_ms": prefill_ms(r) if not weight_only else None}
        fp8_gemm.W8A16_MAX_M, moe_fp8.MOE_W8A16_MAX_TOKENS = limits
        if follow is None:
            ref_rows = rows
            follow = fed  # the FP8 run is fed the reference's greedy tokens
        else:
            top2 = ref_rows.topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1]) / ref_rows.std(dim=-1)
            same = rows.argmax(-1) == ref_rows.argmax(-1)
            n_pre = n_seq * prompt_len
            q = torch.quantile(margin, torch.tensor([0.25, 0.5, 0.75], device=margin.device))
            bands = [same[margin <= q[0]], same[(margin > q[0]) & (margin <= q[1])],
                     same[(margin > q[1]) & (margin <= q[2])], same[margin > q[2]]]
            report[name].update(top1_prefill=same[:n_pre].float().mean().item(),
                                top1_decode=same[n_pre:].float().mean().item(), positions=int(same.numel()),
                                top1_by_margin_quartile=[b.float().mean().item() for b in bands],
                                margin_quartiles=[v.item() for v in q])
        rr = report[name]
        timing = (f"; prefill of {prefill_len} tokens {rr['prefill_ms']:.1f} ms "
                  f"({prefill_len / rr['prefill_ms'] * 1e3:.0f} tok/s)" if rr["prefill_ms"] else "")
        agree = (f"; top-1 = reference ({ref_dtype}): prompt positions {rr['top1_prefill']:.4f}, decode steps "
                 f"{rr['top1_decode']:.4f} over {rr['positions']} positions; by the reference's margin quartile "
                 f"{[round(x, 4) for x in rr['top1_by_margin_quartile']]}" if name != "reference" else "")
        print(f"{name} ({dtype}): weights {weights / 2**30:.3f} GiB, allocated after load {mem / 2**30:.3f} GiB"
              f"{timing}{agree}", flush=True)
        del r
    bf16 = report.get("bf16_dequantized") or report["reference"]
    report["memory_ratio"] = report["fp8"]["weight_bytes"] / bf16["weight_bytes"]
    report["prefill_speedup"] = bf16["prefill_ms"] / report["fp8"]["prefill_ms"]
    print(f"fp8 / bf16 weight memory {report['memory_ratio']:.3f}; {prefill_len}-token prefill "
          f"x{report['prefill_speedup']:.2f}", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="floor,model,serve,exact")
    ap.add_argument("--slice", default=None, help="default /tmp/glm5-slice, with --fp8 /tmp/glm5-slice-fp8")
    ap.add_argument("--fp8", action="store_true", help="the slice in the GLM-5-FP8 layout, its FP8 weights kept FP8")
    ap.add_argument("--agree-seqs", type=int, default=16, help="fp8 phase: sequences")
    ap.add_argument("--agree-steps", type=int, default=64, help="fp8 phase: decode steps per sequence")
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=8, help="requests per point (at least the concurrency)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--graphs", choices=["both", "on", "off"], default="both", help="serve and exact phases: CUDA graphs")
    ap.add_argument("--long-output", type=int, default=0,
                    help="serve phase: one more point at the highest concurrency with this many output tokens")
    ap.add_argument("--prefill-devices", type=int, nargs="+", default=[0], help="serve phase: prefill's GPUs")
    ap.add_argument("--decode-devices", type=int, nargs="+", default=[0], help="serve phase: decode's GPUs")
    ap.add_argument("--decode-tp", type=int, default=1, help="serve phase: decode's tp (= len(--decode-devices))")
    ap.add_argument("--chunk", type=int, default=16384, help="serve phase: prefill's chunked_prefill_size")
    ap.add_argument("--colocate", type=int, default=0, metavar="SMS",
                    help="serve and exact phases: prefill in decode's process, on SMS SMs while decode runs")
    a = ap.parse_args()
    placement = {"prefill": {"devices": a.prefill_devices, "chunked_prefill_size": a.chunk},
                 "decode": {"devices": a.decode_devices, "tp": a.decode_tp}}
    if a.colocate:
        placement["prefill"].update(colocate="d0", colocate_sms=a.colocate)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = a.phases.split(",")
    slice_dir = Path(a.slice or ("/tmp/glm5-slice-fp8" if a.fp8 else "/tmp/glm5-slice"))
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(a)}
    if any(p in phases for p in ("floor", "model", "serve", "fp8")):
        ensure_slice(slice_dir, fp8=a.fp8)

    def save():
        (out / "gpu_e2e.json").write_text(json.dumps(report, indent=1))

    ctx = a.input_len + a.output_len // 2
    if "floor" in phases:
        bw = copy_bandwidth()
        report["copy_bw"] = bw
        report["floor"] = {}
        for bs in sorted(set(a.concurrency) | {1, 64}):
            b = step_bytes(slice_dir, bs, ctx, fp8=a.fp8)
            report["floor"][bs] = {**b, "ms": b["total"] / bw * 1e3}
            print(f"floor bs {bs}: {b['weights'] / 1e9:.2f} GB weights + {b['kv'] / 1e9:.3f} GB KV -> "
                  f"{b['total'] / bw * 1e3:.2f} ms at {bw / 1e12:.2f} TB/s (copy, read + write)", flush=True)
        # the copy buffers' cached blocks would stay with this process while the served instances
        # load (4.5 GiB: enough to run an 80 GB card out of memory at the default fractions)
        torch.cuda.empty_cache()
        save()
    if "model" in phases:
        report["model"] = model_steps(slice_dir, [1, 64], a.input_len, a.iters, fp8=a.fp8)
        torch.cuda.empty_cache()
        save()
    if "fp8" in phases:
        g = torch.Generator().manual_seed(29)
        rand = [torch.randint(10, 4000, (64,), generator=g).tolist() for _ in range(a.agree_seqs)]
        report["fp8"] = {"slice": fp8_checks(slice_dir, rand, a.agree_steps)}
        save()
        tiny = quantised_embedded_model(Path("/tmp/tiny-glm5-fp8"))
        # the first 192 tokens of `transformers` files: third-party code the tiny model never saw
        report["fp8"]["tiny"] = fp8_checks(tiny, package_head_prompts(tiny, "transformers", a.agree_seqs, 192), a.agree_steps,
                                           ref_dtype=torch.float32)
        torch.cuda.empty_cache()
        save()
    if "serve" in phases:
        report["serve"] = []
        for graphs in {"both": (True, False), "on": (True,), "off": (False,)}[a.graphs]:
            report["serve"] += serve_sweep(slice_dir, out, graphs, a.concurrency, a.requests, a.input_len,
                                           a.output_len, a.long_output, placement, "auto" if a.fp8 else "bfloat16")
            save()
        if "floor" in report:
            for r in report["serve"]:
                f = report["floor"][r["concurrency"]]["ms"]
                print(f"graphs {'on ' if r['graphs'] else 'off'} conc {r['concurrency']:3d} out {r['output_len']:4d}: ITL p50 "
                      f"{r['itl_p50'] * 1e3:6.2f} ms, floor {f:5.2f} ms ({r['itl_p50'] * 1e3 / f:4.2f}x); after every "
                      f"prefill {r['itl_after_prefills_p50'] * 1e3:6.2f} ms ({r['itl_after_prefills_p50'] * 1e3 / f:4.2f}x)")
    if "exact" in phases:
        report["exact"] = exact_check(out, {"both": (True, False), "on": (True,), "off": (False,)}[a.graphs],
                                      colocate_sms=a.colocate)
        save()
    save()


if __name__ == "__main__":
    main()

"""FP8 KV cache on one GPU, in one run (made for the device tool):

1. `kernel`: sparse MLA at GLM-5 shapes (64 heads, 512 + 64 latent, 2048 selected slots of a
   32K-token pool, 1 and 64 query tokens): the FP8 Triton kernel against the fp32 reference over
   the dequantized rows, and its time against the bf16 kernels (the Hopper Gluon one that bf16
   dispatches to, and the portable `tl` one the FP8 kernel is built on) over the same values.
2. `accuracy`: the GLM-5-shaped slice (tools/make_slice.py's config and weight law, drawn on the
   GPU instead of written to disk), bf16 weights, bf16 KV vs FP8 KV: greedy decoding of
   `--decode` tokens after 3000-token prompts (contexts past index_topk), the agreement, and the
   logits error teacher-forced on the bf16 run's tokens.
3. `steps`: the decode step (`ModelRunner.forward` + argmax + the token copy back, CUDA graphs
   on) at batch 1 and 64 with 4K-token contexts, bf16 KV vs FP8 KV.

    PYTHONPATH=. python3 benchmarks/fp8_kv.py --out DIR [--phases kernel,accuracy,steps]

A JSON report goes to DIR/fp8_kv.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def bench(fn, calls: int = 20, reps: int = 10) -> float:
    """Microseconds of GPU time per fn() call: `calls` calls captured in one CUDA graph (so no
    launch or Python time is counted), the median over `reps` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


# -- 1. the kernel -----------------------------------------------------------------------------
def kernel_phase() -> list[dict]:
    from glm53.kernels import latent_cache_fp8 as L
    from glm53.kernels.sparse_mla import sparse_mla, sparse_mla_reference
    from glm53.kernels.sparse_mla_fp8_triton import sparse_mla_fp8_triton
    from glm53.kernels.sparse_mla_triton import sparse_mla_triton

    R, P, H, K, ps, n_tok = 512, 64, 64, 2048, 64, 32768
    lay = L.LatentLayout(R, P)
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = n_tok // ps
    cache8 = torch.zeros(pages, 1, ps, lay.bytes_per_token, dtype=torch.uint8, device="cuda")[:, 0]
    latent = torch.randn(n_tok, R + P, generator=g, device="cuda") * torch.rand(n_tok, 1, generator=g, device="cuda")
    slots = torch.arange(n_tok, device="cuda")
    L.store(cache8, slots, latent, lay)
    dense32 = L.gather(cache8, slots, lay).view(pages, ps, R + P)
    dense16 = dense32.to(torch.bfloat16)  # exact: e4m3 x 2^k and the bf16 rope fit bf16
    assert torch.equal(dense16.float(), dense32)
    rows = []
    for T in (1, 64):
        q = torch.randn(T, H, R + P, generator=g, device="cuda").to(torch.bfloat16)
        idx = torch.stack([torch.randperm(n_tok, generator=g, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
        idx[:, -7:] = -1  # some padding
        ref = sparse_mla_reference(q.float(), dense32, idx, 1 / 16, R)
        out8 = sparse_mla(q, cache8, idx, 1 / 16, R)
        err = ((out8.float() - ref).abs().max() / ref.abs().max()).item()
        t8 = bench(lambda: sparse_mla(q, cache8, idx, 1 / 16, R))
        t16 = bench(lambda: sparse_mla(q, dense16, idx, 1 / 16, R))
        t16tl = bench(lambda: sparse_mla_triton(q, dense16, idx, 1 / 16, R, kernel="tl"))
        # bytes the kernel must read: the selected rows (+ q and out, small)
        b8, b16 = T * K * lay.bytes_per_token, T * K * (R + P) * 2
        row = {"T": T, "rel_err_vs_fp32_ref": err, "fp8_us": t8, "bf16_default_us": t16, "bf16_tl_us": t16tl,
               "fp8_rows_GBps": b8 / t8 / 1e3, "bf16_rows_GBps": b16 / t16 / 1e3}
        print(f"kernel T {T:2d}: fp8 {t8:7.1f} us (rel err {err:.2e}), bf16 default {t16:7.1f} us, "
              f"bf16 tl {t16tl:7.1f} us", flush=True)
        sweep = {}
        for bn, st, nw in ((32, 2, 8), (32, 3, 8), (64, 2, 8), (64, 3, 4), (32, 3, 4)):
            key = f"block_n={bn},stages={st},warps={nw}"
            try:
                sweep[key] = bench(lambda: sparse_mla_fp8_triton(q, cache8, idx, 1 / 16, R, block_n=bn,
                                                                 num_stages=st, num_warps=nw))
            except Exception as e:  # a schedule that does not compile (shared memory, registers)
                sweep[key] = repr(e)[:200]
        row["fp8_sweep_us"] = sweep
        print(f"  fp8 schedules: {sweep}", flush=True)
        rows.append(row)
    return rows


# -- the slice, drawn on the GPU ---------------------------------------------------------------
def slice_model(layers: int = 4, experts: int = 16, seed: int = 0):
    from glm53.models import GlmConfig
    from glm53.models.model import GlmForCausalLM
    from glm53.support.glm5_slice import slice_config

    vocab = json.loads((ROOT / "assets" / "tiny-glm5" / "config.json").read_text())["vocab_size"]
    cfg = GlmConfig.from_dict(slice_config(layers, experts, vocab, dense_layers=1))
    with torch.device("cuda"):
        model = GlmForCausalLM(cfg, dtype=torch.bfloat16)
    model.to("cuda")  # buffers made on the CPU explicitly (rope frequencies)
    g = torch.Generator(device="cuda").manual_seed(seed)
    # make_slice's law (_init): fan-in scaled Gaussians, norms near 1, small biases
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device="cuda")
            if name.endswith(("norm.weight", "layernorm.weight")):
                r = 1.0 + 0.05 * r
            elif name.endswith(("k_norm.bias", "e_score_correction_bias")):
                r = 0.05 * r
            elif name == "lm_head.weight":
                r = 4.0 * r / p.shape[-1] ** 0.5
            elif name != "model.embed_tokens.weight":
                r = r / p.shape[-1] ** 0.5
            p.copy_(r)
    return model


def runners(model, pages: int, max_context: int):
    from glm53.models import ModelRunner
    from glm53.models.graph import GraphConfig
    from glm53.models.kv_cache import FP8

    out, cap = {}, {}
    for name, kv in (("bf16", None), ("fp8", FP8)):
        t0 = time.perf_counter()
        out[name] = ModelRunner(model, num_pages=pages, page_size=64, device="cuda",
                                graphs=GraphConfig(max_bs=64, max_context=max_context), kv_dtype=kv)
        cap[name] = time.perf_counter() - t0
    return out, cap


def greedy(runner, prompts, pages, new):
    from glm53.models import SeqChunk

    logits = runner.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)])
    outs = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(new - 1):
        chunks = [SeqChunk([o[-1]], len(p) + len(o) - 1, pg) for p, o, pg in zip(prompts, outs, pages)]
        toks = torch.cat(runner.forward(chunks)).argmax(-1).tolist()
        for o, t in zip(outs, toks):
            o.append(t)
    return outs


def accuracy_phase(rs, n_prompts: int, prompt_len: int, new: int) -> dict:
    from glm53.models import SeqChunk

    g = torch.Generator().manual_seed(1)
    vocab = rs["bf16"].cfg.vocab_size
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(n_prompts)]
    need = -(-(prompt_len + new) // 64)
    pages = [list(range(i * need, (i + 1) * need)) for i in range(n_prompts)]
    outs = {k: greedy(r, prompts, pages, new) for k, r in rs.items()}
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), new) for x, y in zip(outs["bf16"], outs["fp8"])]
    agree = sum(a == b for x, y in zip(outs["bf16"], outs["fp8"]) for a, b in zip(x, y)) / (n_prompts * new)
    # teacher-forced on the bf16 tokens: logits at every decoded position, both caches
    err, ref_max, top1, n = 0.0, 0.0, 0, 0
    mean_err = []
    for p, o, pg in zip(prompts, outs["bf16"], pages):
        seq = p + o[:-1]
        lg = {k: r.forward([SeqChunk(seq, 0, pg, all_logits=True)])[0][len(p) - 1:] for k, r in rs.items()}
        d = (lg["fp8"] - lg["bf16"]).abs()
        err = max(err, d.max().item())
        mean_err.append(d.mean().item())
        ref_max = max(ref_max, lg["bf16"].abs().max().item())
        top1 += (lg["fp8"].argmax(-1) == lg["bf16"].argmax(-1)).sum().item()
        n += lg["bf16"].shape[0]
    res = {"prompts": n_prompts, "prompt_len": prompt_len, "decoded": new, "greedy_identical_prefix": same,
           "greedy_token_agreement": agree, "tf_max_abs_logit_err": err, "tf_mean_abs_logit_err": statistics.mean(mean_err),
           "tf_max_abs_logit": ref_max, "tf_top1_agreement": top1 / n}
    print(f"accuracy: greedy identical prefixes {same} of {new}, token agreement {agree:.3f}; teacher-forced "
          f"logits max err {err:.3f} (max |logit| {ref_max:.2f}), mean err {res['tf_mean_abs_logit_err']:.4f}, "
          f"top-1 agreement {top1 / n:.4f}", flush=True)
    return res


def fill_random(runner) -> None:
    """Random KV in every pool (realistic indexer scores, no all-tie top-k), through the FP8
    writers for byte pools."""
    from glm53.kernels import index_cache_fp8, latent_cache_fp8
    from glm53.models.kv_cache import INDEX_K, LATENT

    n = runner.pools.num_pages * runner.page_size
    slots = torch.arange(n, device="cuda")
    for name, pool in runner.pools:
        if pool.dtype != torch.uint8:
            pool.tensor.normal_()
            continue
        for layer in pool.layers:
            view = pool.view(layer)
            if name == LATENT:
                lay = latent_cache_fp8.LatentLayout.for_config(runner.cfg)
                latent_cache_fp8.store(view, slots, torch.randn(n, lay.rank + lay.rope, device="cuda"), lay)
            elif name == INDEX_K:
                index_cache_fp8.store(view.flatten(1), slots, torch.randn(n, runner.cfg.index_head_dim, device="cuda"))


def steps_phase(rs, sizes, ctx: int, iters: int, need: int) -> list[dict]:
    from glm53.models import SeqChunk

    rows = []
    for k, runner in rs.items():
        fill_random(runner)
        for bs in sizes:
            toks, times = [1] * bs, []
            for it in range(iters):
                chunks = [SeqChunk([toks[i]], ctx + it, list(range(i * need, (i + 1) * need))) for i in range(bs)]
                torch.cuda.synchronize()
                t = time.perf_counter()
                toks = torch.cat(runner.forward(chunks)).argmax(-1).tolist()
                times.append(time.perf_counter() - t)
            ms = statistics.median(times[3:]) * 1e3
            rows.append({"kv": k, "bs": bs, "ctx": ctx, "ms": ms})
            print(f"decode step {k} bs {bs:3d} ctx {ctx}: {ms:7.2f} ms (graphs)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="kernel,accuracy,steps")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--decode", type=int, default=256)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = a.phases.split(",")
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(a)}

    def save():
        (out / "fp8_kv.json").write_text(json.dumps(report, indent=1))

    t0 = time.perf_counter()
    if "kernel" in phases:
        report["kernel"] = kernel_phase()
        save()
    if "accuracy" in phases or "steps" in phases:
        model = slice_model()
        need = -(-(max(a.ctx + a.iters, a.prompt_len + a.decode) + 64) // 64)
        rs, cap = runners(model, need * 64, need * 64)
        report["capture_s"] = cap
        print(f"slice built, graphs captured {cap}", flush=True)
        if "accuracy" in phases:
            report["accuracy"] = accuracy_phase(rs, a.prompts, a.prompt_len, a.decode)
            save()
        if "steps" in phases:
            report["steps"] = steps_phase(rs, [1, 64], a.ctx, a.iters, need)
            save()
    report["wall_s"] = time.perf_counter() - t0
    save()
    print(f"done in {report['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""Pipeline-parallel prefill with DFlash on GPUs, in one run (issue 20; made for the device tool's
four-GPU kind, and runnable on the CPU with the embedded model to check the script itself):

1. `kv`: one prompt prefilled by pp = 1 and pp = P stages (GPUs 0 .. P − 1, chunks pipelined as
   micro-batches, the draft's context projected partially per stage) into one decode rank on the
   last GPU, in its own process as in serving, through real NIXL transfers. The first token and
   decode's target KV (`latent`, `index_k`) and draft KV (`draft_kv`) must be byte-identical, and
   every prefill rank must post the descriptors `transport.mapping` plans for it.
   `tp` (issue 19, two GPUs): the same with prefill tp = 2 against tp = 1 (first token and
   descriptor counts; the pools are compared but TP's all-reduce need not be bit-equal).
2. `serve`: the model served with DFlash (`glm53-serve up`): prefill pp = P on GPUs 0 .. P − 1 and
   decode on the last GPU, against prefill pp = 1 on GPU 0; greedy outputs of prompts sent one at
   a time (so every batch has the same shapes in both runs) must be equal.
3. `ttft`: time to first token against prompt length for each pp (chunked prefill, consecutive
   chunks pipelined), the speed-up over pp = 1 beside the ideal pp×, and the bytes each stage
   boundary carries per token (hidden + residual + the draft's fp32 accumulator), measured.

    PYTHONPATH=. python3 benchmarks/gpu_pp.py --out DIR [--phases kv,tp,serve,ttft] [--pp 3] [--slice DIR]
    PYTHONPATH=. python benchmarks/gpu_pp.py --out DIR --device cpu   # the embedded model, CPU

On CUDA the model is a GLM-5-shaped slice of 8 layers (tools/make_slice.py; written to --slice
unless there) with a 2-layer DFlash draft reading target layers 1, 3, 5 and 7 (tools/make_draft.py),
so with pp = 3 (layers 0–2, 3–5, 6–7) features come from every stage, one from a stage's last
layer. A JSON report goes to DIR/gpu_pp.json; the servers' logs beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

TIMEOUT_S = 300.0


def models(args) -> tuple[Path, Path]:
    """(target, draft) directories: the slice and its draft on CUDA, the embedded model and a
    random draft on the CPU."""
    if args.device == "cpu":
        from glm53.models import write_random_draft
        from glm53.server.embedded_model import ensure_embedded_model

        model = ensure_embedded_model()
        draft = Path(args.out) / "draft"
        if not (draft / "config.json").exists():
            write_random_draft(draft, model, seed=4, n_layers=2, block_size=4)
        return model, draft
    model, draft = Path(args.slice), Path(args.slice + "-draft")
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_slice.py"), str(model), "--layers", "8",
                        "--experts", "16", "--dense-layers", "1"], check=True)
    if not (draft / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_draft.py"), str(model), str(draft), "--layers", "2",
                        "--block-size", "8", "--heads", "48", "--kv-heads", "8", "--head-dim", "128",
                        "--intermediate-size", "12288", "--target-layer-ids", "1", "3", "5", "7"], check=True)
    return model, draft


# -- kv: decode's pools after pp = 1 and pp = P (glm53/support/pd_harness.py) ------------------
def prefilled(args, model: Path, draft: Path, out: Path, **parallel):
    from glm53.models import GlmConfig
    from glm53.support.pd_harness import prefill_into_decode

    g = torch.Generator().manual_seed(12)
    vocab = GlmConfig.from_dir(model).vocab_size
    prompt = torch.randint(10, vocab - 10, (args.kv_prompt,), generator=g).tolist()
    return prefill_into_decode(model, draft, prompt, device=args.device, page_size=args.page_size, chunk=args.chunk,
                               workdir=out, timeout_s=TIMEOUT_S, **parallel)


def compare(ref, got, tag: str) -> dict:
    """First tokens, descriptor counts against the mapping, and decode's pools, byte for byte."""
    row = {"pages": int(next(iter(ref.pools.values())).shape[0]), f"first_{tag}": got.first, "first_ref": ref.first,
           "first_equal": ref.first == ref.decode_first == got.first == got.decode_first,
           "forward_s": {"ref": ref.forward_s, tag: got.forward_s},
           "descs": {"ref": ref.descs, tag: got.descs}, "descs_as_planned": ref.descs == ref.predicted and
           got.descs == got.predicted, "predicted": {"ref": ref.predicted, tag: got.predicted}}
    for name, t in ref.pools.items():
        other = got.pools[name]
        same = bool(torch.equal(t.view(torch.uint8), other.view(torch.uint8)))
        row[name] = {"bytes": t.numel() * t.element_size(), "written": bool(t.abs().sum() > 0), "identical": same,
                     "max_abs_diff": 0.0 if same or t.dtype == torch.uint8 else float((t.float() - other.float()).abs().max())}
    return row


def kv_phase(args, model: Path, draft: Path, out: Path) -> dict:
    row = compare(prefilled(args, model, draft, out), prefilled(args, model, draft, out, pp=args.pp), f"pp{args.pp}")
    print("kv:", json.dumps(row), flush=True)
    return row


def tp_phase(args, model: Path, draft: Path, out: Path) -> dict:
    """Prefill tp = 2 into decode tp = 1 (issue 19): descriptors as planned, the same first token;
    decode's pools against tp = 1 (TP's all-reduce sums in another order, so not bit-equal in general)."""
    row = compare(prefilled(args, model, draft, out), prefilled(args, model, draft, out, tp=2), "tp2")
    print("tp:", json.dumps(row), flush=True)
    return row


# -- serve: greedy outputs, pp = P vs pp = 1 -----------------------------------------------------
def serve_phase(args, model: Path, draft: Path, out: Path) -> dict:
    import httpx

    from glm53.support.gpu_server import Server, cluster_config

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    lengths = [int(x) for x in args.serve_prompts.split(",")]
    prompts = [[(i * 37 + 11 * n) % (vocab - 20) + 10 for i in range(n)] for n in lengths]
    cuda = args.device == "cuda"
    outputs, report = {}, {}
    for pp in (1, args.pp):
        cfg = cluster_config(str(model), "bfloat16" if cuda else "float32", True, [0] * 5, max(lengths) + args.new + 64,
                             args.device)
        cfg["speculative"] = {"algorithm": "DFLASH", "draft_model_path": str(draft)}
        cfg["prefill"][0].update(pp=pp, chunked_prefill_size=args.chunk)
        if cuda:
            cfg["prefill"][0]["devices"] = list(range(pp))
            cfg["decode"][0]["devices"] = [torch.cuda.device_count() - 1]
        tag = f"serve-pp{pp}"
        with Server(cfg, out, tag) as s, httpx.Client(timeout=TIMEOUT_S) as http:
            outs, t0 = [], time.monotonic()
            for p in prompts:  # one at a time: the same batch shapes in both runs
                r = http.post(f"{s.url}/generate", json={"input_ids": p, "sampling_params": {
                    "max_new_tokens": args.new, "temperature": 0, "ignore_eos": True}})
                r.raise_for_status()
                outs.append(r.json()["output_ids"])
            outputs[pp] = outs
            report[tag] = {"startup_s": s.startup_s, "requests_s": time.monotonic() - t0}
    report["prompt_lens"] = lengths
    report["greedy_equal"] = f"{sum(a == b for a, b in zip(outputs[1], outputs[args.pp]))}/{len(prompts)}"
    print("serve:", json.dumps(report), flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="kv,serve,ttft")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--pp", type=int, default=3, help="the pipeline compared with pp = 1 (kv, serve)")
    ap.add_argument("--slice", default="/tmp/glm5-slice8")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 2048 on CUDA, 64 on CPU)")
    ap.add_argument("--kv-prompt", type=int, default=None, help="default 6000 on CUDA, 300 on CPU")
    ap.add_argument("--serve-prompts", default=None, help="comma-separated prompt lengths")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="ttft prompt lengths")
    ap.add_argument("--ttft-pp", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.page_size = 64 if cuda else 16
    args.chunk = args.chunk or (2048 if cuda else 64)
    args.kv_prompt = args.kv_prompt or (6000 if cuda else 300)
    args.serve_prompts = args.serve_prompts or ("7,100,300,2100,5000" if cuda else "7,100,300")
    args.lengths = args.lengths or ([4096, 16384, 65536] if cuda else [256, 512])
    need = max(args.pp + 1 if {"kv", "serve"} & set(args.phases.split(",")) else 1, 2)
    if cuda and torch.cuda.device_count() < need:
        raise SystemExit(f"needs {need} GPUs, found {torch.cuda.device_count()}")
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, draft = models(args)
    report, phases = {"pp": args.pp, "device": args.device, "model": str(model)}, args.phases.split(",")
    for name, fn in (("kv", kv_phase), ("tp", tp_phase), ("serve", serve_phase)):
        if name in phases:
            t0 = time.monotonic()
            try:
                report[name] = fn(args, model, draft, out)
            except Exception as e:  # one phase's failure is a result, not the end of the run
                report[name] = {"error": repr(e)[:600]}
                print(name, "failed:", repr(e)[:600], flush=True)
            print(f"({name}: {time.monotonic() - t0:.0f} s)", flush=True)
    if "ttft" in phases:
        from glm53.support.pp_ttft import ttft_table

        report["ttft"] = ttft_table(model, draft, args.lengths, args.ttft_pp, args.chunk, args.repeat, args.device,
                                    "bfloat16" if cuda else "float32", args.page_size)
    (out / "gpu_pp.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()

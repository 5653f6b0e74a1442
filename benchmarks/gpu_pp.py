"""Pipeline-parallel prefill with DFlash on GPUs, in one run (issue 20; made for the device tool's
four-GPU kind, and runnable on the CPU with the embedded model to check the script itself):

1. `kv`: one prompt prefilled by pp = 1 and pp = P stages (GPUs 0 .. P − 1, chunks pipelined as
   micro-batches, the draft's context projected partially per stage) into one decode rank on the
   last GPU, in its own process as in serving, through real NIXL transfers. The first token and
   decode's target KV (`latent`, `index_k`) and draft KV (`draft_kv`) must be byte-identical.
2. `serve`: the model served with DFlash (`glm53-serve up`): prefill pp = P on GPUs 0 .. P − 1 and
   decode on the last GPU, against prefill pp = 1 on GPU 0; greedy outputs of prompts sent one at
   a time (so every batch has the same shapes in both runs) must be equal.
3. `ttft`: time to first token against prompt length for each pp (chunked prefill, consecutive
   chunks pipelined), the speed-up over pp = 1 beside the ideal pp×, and the bytes each stage
   boundary carries per token (hidden + residual + the draft's fp32 accumulator), measured.

    python3 benchmarks/gpu_pp.py --out DIR [--phases kv,serve,ttft] [--pp 3] [--slice DIR]
    PYTHONPATH=. python benchmarks/gpu_pp.py --out DIR --device cpu   # the embedded model, CPU

On CUDA the model is a GLM-5-shaped slice of 8 layers (tools/make_slice.py; written to --slice
unless there) with a 2-layer DFlash draft reading target layers 1, 3, 5 and 7 (tools/make_draft.py),
so with pp = 3 (layers 0–2, 3–5, 6–7) features come from every stage, one from a stage's last
layer. A JSON report goes to DIR/gpu_pp.json; the servers' logs beside it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ROOM = (7, 0)
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


# -- kv: decode's pools after pp = 1 and pp = P --------------------------------------------------
def kv_config(args, model: Path, draft: Path, pp: int, pages: int) -> dict:
    from tests.net import free_ports

    ports = free_ports(4)
    cuda = args.device == "cuda"
    return {
        "model": {"path": str(model)},
        "transfer": {"bootstrap_timeout_s": 120, "transfer_timeout_s": 120},
        "speculative": {"algorithm": "DFLASH", "draft_model_path": str(draft)},
        "defaults": {"device": args.device, "dtype": "bfloat16" if cuda else "float32", "page_size": args.page_size,
                     "num_pages": pages, "disable_cuda_graph": True},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1], "pp": pp,
                     **({"devices": list(range(pp))} if cuda else {}),
                     **({"dist_init_port": ports[3]} if pp > 1 else {})}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2],
                    **({"devices": [torch.cuda.device_count() - 1]} if cuda else {})}],
    }


def decode_side(raw: dict, model: str, bootstrap: str, pages: list[int], out: str, q) -> None:
    """Decode's one rank in its own process: receive the room, save its pages of every pool."""
    from glm53.models import GlmConfig
    from glm53.server.config import parse_config
    from glm53.server.engine.worker import RankWorker, rank_specs
    from glm53.transport import TERMINAL, KVPoll, Room, RoomTransfer

    torch.set_grad_enabled(False)
    cfg = parse_config(raw)
    (spec,) = rank_specs(cfg, cfg.decode[0], model, GlmConfig.from_dir(model).num_hidden_layers)
    rank = RankWorker(spec)
    rank.allocate(raw["defaults"]["num_pages"])
    try:
        rx = RoomTransfer([rank.create_receiver(Room(*ROOM), bootstrap, pages)])
        q.put("ready")
        deadline = time.monotonic() + TIMEOUT_S
        while rx.poll() not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.005)
        if rx.poll() != KVPoll.SUCCESS:
            q.put(f"receiver ended {rx.poll()}: {rx.error}")
            return
        torch.save({"first": rx.metadata().first_token_ids,
                    "pools": {name: pool.tensor[pages].cpu() for name, pool in rank.runner.pools}}, out)
        q.put("done")
    finally:
        rank.close()


def prefill_into_decode(args, model: Path, draft: Path, pp: int, prompt: list[int], out: Path) -> dict:
    from glm53.models import GlmConfig, SeqChunk
    from glm53.server.config import parse_config
    from glm53.server.engine.group import LocalWorkers
    from glm53.server.engine.processes import ProcessWorkers
    from glm53.server.engine.worker import rank_specs
    from glm53.transport import BootstrapServer, KVPoll, MetadataRow, Room

    n_pages = -(-len(prompt) // args.page_size)
    raw = kv_config(args, model, draft, pp, n_pages + 8)
    cfg = parse_config(raw)
    inst = cfg.prefill[0]
    boot = BootstrapServer("p0", pp_size=pp, tp_size=1, host="127.0.0.1", port=inst.bootstrap_port)
    specs = rank_specs(cfg, inst, str(model), GlmConfig.from_dir(model).num_hidden_layers)
    ranks = LocalWorkers(specs) if pp == 1 else ProcessWorkers(specs, timeout_s=TIMEOUT_S, port=inst.engine.dist_init_port)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    pages = list(range(3, 3 + n_pages))  # not from page 0: offsets must be right
    child = ctx.Process(target=decode_side, args=(raw, str(model), boot.address, pages, str(out), q))
    child.start()
    try:
        if (msg := q.get(timeout=TIMEOUT_S)) != "ready":
            raise RuntimeError(msg)
        tx = ranks.create_senders(Room(*ROOM), "d0")
        chunk = args.chunk
        mbs = [[SeqChunk(prompt[i : i + chunk], i, pages)] for i in range(0, len(prompt), chunk)]
        t0 = time.perf_counter()
        logits = ranks.forward_microbatches(mbs)  # one step: the chunks pipeline through the stages
        first = int(logits[-1][0][-1].argmax())
        forward_s = time.perf_counter() - t0
        tx.send_pages(pages, start=0)
        tx.finish(MetadataRow(first_token_ids=(first,), counts=(len(prompt), len(prompt))))
        deadline = time.monotonic() + TIMEOUT_S
        while tx.poll() not in (KVPoll.SUCCESS, KVPoll.FAILED) and time.monotonic() < deadline:
            ranks.sync()
            time.sleep(0.005)
        if tx.poll() != KVPoll.SUCCESS:
            raise RuntimeError(f"sender ended {tx.poll()}")
        if (msg := q.get(timeout=TIMEOUT_S)) != "done":
            raise RuntimeError(msg)
        child.join(TIMEOUT_S)
        got = torch.load(out)
        return {"first": first, "decode_first": got["first"], "pools": got["pools"], "forward_s": forward_s}
    finally:
        if child.is_alive():
            child.kill()
        ranks.close()
        boot.close()


def kv_phase(args, model: Path, draft: Path, out: Path) -> dict:
    g = torch.Generator().manual_seed(12)
    from glm53.models import GlmConfig

    vocab = GlmConfig.from_dir(model).vocab_size
    prompt = torch.randint(10, vocab - 10, (args.kv_prompt,), generator=g).tolist()
    ref = prefill_into_decode(args, model, draft, 1, prompt, out / "kv-pp1.pt")
    got = prefill_into_decode(args, model, draft, args.pp, prompt, out / f"kv-pp{args.pp}.pt")
    row = {"prompt": len(prompt), "chunk": args.chunk, "first_pp1": ref["first"], f"first_pp{args.pp}": got["first"],
           "first_equal": ref["first"] == got["first"] == ref["decode_first"][0] == got["decode_first"][0],
           "forward_s": {1: ref["forward_s"], args.pp: got["forward_s"]}}
    for name, t in ref["pools"].items():
        other = got["pools"][name]
        row[name] = {"bytes": t.numel() * t.element_size(), "written": bool(t.abs().sum() > 0),
                     "identical": bool(torch.equal(t.view(torch.uint8), other.view(torch.uint8)))}
    print("kv:", json.dumps(row), flush=True)
    return row


# -- serve: greedy outputs, pp = P vs pp = 1 -----------------------------------------------------
def serve_phase(args, model: Path, draft: Path, out: Path) -> dict:
    import httpx

    from gpu_e2e import Server, cluster_config

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    lengths = [int(x) for x in args.serve_prompts.split(",")]
    prompts = [[(i * 37 + 11 * n) % (vocab - 20) + 10 for i in range(n)] for n in lengths]
    cuda = args.device == "cuda"
    outputs, report = {}, {}
    for pp in (1, args.pp):
        cfg = cluster_config(str(model), "bfloat16" if cuda else "float32", True, [0] * 5, max(lengths) + args.new + 64)
        cfg["speculative"] = {"algorithm": "DFLASH", "draft_model_path": str(draft)}
        cfg["prefill"][0].update(pp=pp, chunked_prefill_size=args.chunk)
        if cuda:
            cfg["prefill"][0]["devices"] = list(range(pp))
            cfg["decode"][0]["devices"] = [torch.cuda.device_count() - 1]
        else:
            for e in (cfg["prefill"][0], cfg["decode"][0], cfg["defaults"]):
                e.update(device="cpu", page_size=args.page_size)
                e.pop("devices", None)
                e.pop("mem_fraction_static", None)
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
    if cuda and torch.cuda.device_count() < args.pp + 1:
        raise SystemExit(f"needs {args.pp + 1} GPUs, found {torch.cuda.device_count()}")
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, draft = models(args)
    report, phases = {"pp": args.pp, "device": args.device, "model": str(model)}, args.phases.split(",")
    for name, fn in (("kv", kv_phase), ("serve", serve_phase)):
        if name in phases:
            t0 = time.monotonic()
            try:
                report[name] = fn(args, model, draft, out)
            except Exception as e:  # one phase's failure is a result, not the end of the run
                report[name] = {"error": repr(e)[:600]}
                print(name, "failed:", repr(e)[:600], flush=True)
            print(f"({name}: {time.monotonic() - t0:.0f} s)", flush=True)
    if "ttft" in phases:
        from pp_cpu import ttft_table

        report["ttft"] = ttft_table(model, draft, args.lengths, args.ttft_pp, args.chunk, args.repeat, args.device,
                                    "bfloat16" if cuda else "float32", args.page_size)
    (out / "gpu_pp.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()

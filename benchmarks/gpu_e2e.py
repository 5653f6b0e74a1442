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

    python3 benchmarks/gpu_e2e.py --out DIR [--phases floor,model,serve,exact] [--slice DIR]

The router needs fastapi, starlette, pydantic (+ pydantic_core, annotated-types,
typing-inspection) and uvicorn, which the device image lacks: carry them as wheels.

The slice (tools/make_slice.py: GLM-5 widths, 4 layers, 16 experts) is written to --slice unless
it exists. A JSON report goes to DIR/gpu_e2e.json; servers' logs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def ensure_slice(slice_dir: Path) -> Path:
    """Issue 16's GLM-5-shaped slice (4 layers, 16 experts, 1 dense), written unless it exists."""
    if not (slice_dir / "config.json").exists():
        t0 = time.monotonic()
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_slice.py"), str(slice_dir), "--layers", "4",
                        "--experts", "16", "--dense-layers", "1"], check=True)
        print(f"slice written in {time.monotonic() - t0:.0f} s", flush=True)
    return slice_dir


# -- the floor ---------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 1 << 31, reps: int = 10) -> float:
    """Device copy bandwidth, bytes read + written per second (a 2 GiB copy)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (s.elapsed_time(e) / 1e3)


def step_bytes(model_dir: Path, bs: int, ctx: int) -> dict:
    """Bytes a decode step of `bs` requests at context `ctx` must read: every weight except the
    routed experts and the embedding, the routed experts a batch hits (expected distinct experts
    under uniform routing, which random weights give), `bs` embedding rows; per request and layer
    the top-k latent rows sparse MLA reads, and on full layers every indexer key."""
    from glm53.models import GlmConfig
    from glm53.models.model import GlmForCausalLM

    cfg = GlmConfig.from_dir(model_dir)
    with torch.device("meta"):
        m = GlmForCausalLM(cfg, dtype=torch.bfloat16)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = e * (1 - (1 - k / e) ** bs) if e else 0
    w = 0.0
    for name, p in m.named_parameters():
        n = p.numel() * p.element_size()
        if ".experts." in name:
            w += n * hit / e
        elif "embed_tokens" in name:
            w += bs * p.shape[1] * p.element_size()
        else:
            w += n
    per_req = cfg.num_hidden_layers * min(ctx, cfg.index_topk) * cfg.latent_dim * 2
    per_req += len(cfg.full_layers) * ctx * cfg.index_head_dim * 2
    return {"weights": w, "kv": bs * per_req, "total": w + bs * per_req}


# -- the model's step alone --------------------------------------------------------------------
def model_steps(model_dir: Path, sizes: list[int], ctx: int, iters: int) -> list[dict]:
    from glm53.models import ModelRunner, SeqChunk
    from glm53.models.graph import GraphConfig

    base = ModelRunner.from_dir(model_dir, page_size=64, num_pages=1, device="cuda", progress=False)
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


# -- serving -----------------------------------------------------------------------------------
def cluster_config(model: str, dtype: str, graphs: bool, ports: list[int], context: int, device: str = "cuda") -> dict:
    """One prefill and one decode instance; on "cuda" both on GPU 0 (one-GPU PD, memory shares
    set), on "cpu" (to check a GPU script here) 16-token pages."""
    http, result, p_port, p_boot, d_port = ports
    cpu = device == "cpu"
    eng = {"device": device, "dtype": dtype, "page_size": 16 if cpu else 64, **({} if cpu else {"devices": [0]})}
    p_share, d_share = ({}, {}) if cpu else ({"mem_fraction_static": 0.4}, {"mem_fraction_static": 0.45})
    return {
        "name": "gpu-e2e",
        "model": {"path": model, "served_model_name": ["m"], "context_length": context},
        "router": {"host": "127.0.0.1", "port": http, "result_port": result, "startup_timeout_s": 900},
        "transfer": {"backend": "nixl", "bootstrap_timeout_s": 60, "transfer_timeout_s": 120},
        "defaults": {"device": device, "dtype": dtype, "page_size": eng["page_size"]},
        "prefill": [{**eng, "name": "p0", "host": "127.0.0.1", "port": p_port, "bootstrap_port": p_boot,
                     **p_share, "max_running_requests": 16, "chunked_prefill_size": 16384}],
        "decode": [{**eng, "name": "d0", "host": "127.0.0.1", "port": d_port, **d_share,
                    "max_running_requests": 64, "disable_cuda_graph": not graphs, "cuda_graph_max_bs": 64}],
    }


class Server:
    def __init__(self, cfg: dict, workdir: Path, tag: str):
        from tests.net import free_ports

        self.cfg = cfg
        http, result, p_port, p_boot, d_port = free_ports(5)
        cfg["router"].update(port=http, result_port=result)
        cfg["prefill"][0].update(port=p_port, bootstrap_port=p_boot)
        cfg["decode"][0].update(port=d_port)
        self.path = workdir / f"{tag}.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.url = f"http://127.0.0.1:{http}"
        self.log = open(workdir / f"{tag}.log", "w+")
        self.proc = None

    def __enter__(self) -> "Server":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "glm53.server.cli", "up", "--config", str(self.path)],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        while time.monotonic() - t0 < 900:
            line = self.proc.stdout.readline()
            if "ready" in line:
                self.startup_s = time.monotonic() - t0
                print(f"  up in {self.startup_s:.0f} s", flush=True)
                return self
            if not line and self.proc.poll() is not None:
                break
        self.log.flush()
        self.log.seek(0)
        tail = self.log.read()[-6000:]
        self.__exit__()
        raise RuntimeError(f"server did not become ready:\n{tail}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


def serve_sweep(model_dir: Path, out: Path, graphs: bool, conc: list[int], n_req: int, in_len: int,
                out_len: int, long_out: int = 0, placement: dict | None = None) -> list[dict]:
    """The sweep; with `long_out`, one more point at the highest concurrency with that many
    output tokens, so that most of its decode steps run after every prefill is done. `placement`:
    per role the instance keys that place it (devices, tp); default both on GPU 0."""
    from serving import sweep_point

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    placement = placement or {}
    where = "".join(f"-{role[0]}{'.'.join(map(str, p['devices']))}" + (f"-tp{p['tp']}" if p.get("tp", 1) > 1 else "")
                    + (f"-colocated{p['colocate_sms']}" if p.get("colocate") else "") for role, p in placement.items())
    tag = f"serve-graphs-{'on' if graphs else 'off'}{where}"
    print(f"{tag}:", flush=True)
    context = in_len + max(out_len, long_out) + 64
    cfg = cluster_config(str(model_dir), "bfloat16", graphs, [0] * 5, context)
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


# -- exactness ---------------------------------------------------------------------------------
PROMPT_LENS = (7, 100, 300, 41, 180, 65)


def cpu_reference(model: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy outputs of `glm53-serve generate` on the CPU (the reference path)."""
    cmd = [sys.executable, "-m", "glm53.server.cli", "generate", "--model", str(model), "--max-new-tokens", str(new),
           "--page-size", "16", "--ignore-eos"]
    for p in prompts:
        cmd += ["--input-ids", ",".join(map(str, p))]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return [json.loads(line)["output_ids"] for line in res.stdout.splitlines()]


async def served_greedy(url: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy outputs of a served model for `prompts`, sent at once."""
    import httpx

    async with httpx.AsyncClient(timeout=300) as http:
        async def one(p):
            r = await http.post(f"{url}/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": new, "temperature": 0, "ignore_eos": True}})
            r.raise_for_status()
            return r.json()["output_ids"]
        return await asyncio.gather(*(one(p) for p in prompts))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="floor,model,serve,exact")
    ap.add_argument("--slice", default="/tmp/glm5-slice")
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
    slice_dir = Path(a.slice)
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(a)}
    if any(p in phases for p in ("floor", "model", "serve")):
        ensure_slice(slice_dir)

    def save():
        (out / "gpu_e2e.json").write_text(json.dumps(report, indent=1))

    ctx = a.input_len + a.output_len // 2
    if "floor" in phases:
        bw = copy_bandwidth()
        report["copy_bw"] = bw
        report["floor"] = {}
        for bs in sorted(set(a.concurrency) | {1, 64}):
            b = step_bytes(slice_dir, bs, ctx)
            report["floor"][bs] = {**b, "ms": b["total"] / bw * 1e3}
            print(f"floor bs {bs}: {b['weights'] / 1e9:.2f} GB weights + {b['kv'] / 1e9:.3f} GB KV -> "
                  f"{b['total'] / bw * 1e3:.2f} ms at {bw / 1e12:.2f} TB/s (copy, read + write)", flush=True)
        save()
    if "model" in phases:
        report["model"] = model_steps(slice_dir, [1, 64], a.input_len, a.iters)
        torch.cuda.empty_cache()
        save()
    if "serve" in phases:
        report["serve"] = []
        for graphs in {"both": (True, False), "on": (True,), "off": (False,)}[a.graphs]:
            report["serve"] += serve_sweep(slice_dir, out, graphs, a.concurrency, a.requests, a.input_len,
                                           a.output_len, a.long_output, placement)
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

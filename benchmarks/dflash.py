"""DFlash on vs off: decode tokens/s and τ (mean tokens committed per verify step) of the decode
scheduler's real loop on one in-process rank, in one run.

    PYTHONPATH=. python benchmarks/dflash.py [--device cpu|cuda] [--batch 1 8] [--new 64]

Rows: plain decoding; DFlash with the given draft (default: a random draft written for the
embedded model, so τ ≈ 1 and the row shows the overhead); DFlash with *oracle* proposals (the
draft's output replaced by the true greedy continuation), which shows what a perfect draft buys
at this block size on this machine — an upper bound, not a claim about any trained draft.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk, write_random_draft
from glm53.server.config import parse_config
from glm53.server.embedded_model import ensure_embedded_model
from glm53.server.engine.decode import DecodeRequest, DecodeScheduler
from glm53.server.offline import greedy_generate
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from tests.net import free_ports


def scheduler(model_dir: Path, draft: Path | None, device: str, block: int | None, graphs: bool = True,
              max_running: int = 64, dtype: str = "float32", context: int | None = None) -> DecodeScheduler:
    """A decode scheduler on one in-process rank (no prefill instance is started). On CUDA it
    captures its decode graphs (with a draft: of the DFlash step) for batches up to
    `max_running` and requests up to `context` tokens (None: the model's) unless `graphs` is False."""
    ports = free_ports(4)
    raw = {
        "model": {"path": str(model_dir), **({"context_length": context} if context else {})},
        "defaults": {"device": device, "dtype": dtype, "page_size": 16, "num_pages": 2048,
                     "stream_interval": 1000, "max_running_requests": max_running,
                     "disable_cuda_graph": not graphs},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2], **({"devices": [0]} if device == "cuda" else {})}],
    }
    if device == "cuda":
        raw["prefill"][0]["devices"] = [1]  # never started here; the config wants distinct GPUs
    if draft is not None:
        raw["speculative"] = {"algorithm": "DFLASH", "draft_model_path": str(draft), "num_draft_tokens": block}
    cfg = parse_config(raw)
    return DecodeScheduler(cfg, cfg.decode[0])


def decode_run(sched: DecodeScheduler, prompts: list[list[int]], new: int,
               clock=time.perf_counter) -> tuple[float, int, int, list]:
    """(seconds of decode steps, tokens committed after the first, verify steps, outputs).
    `clock=time.thread_time` counts only this thread's CPU time (on a CPU shared with other
    jobs, wall time also counts the time the scheduler gave to them)."""
    sent = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    for room, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        req = GenerateRequest(spec=RequestSpec(f"r{room}", p, params, []), room=room, generation=0,
                              prefill=PeerInfo("p0", "prefill", "h", 1, 2), decode=PeerInfo("d0", "decode", "h", 3, None),
                              reply_to="tcp://unused:1")
        r = DecodeRequest(req, arrived=0.0, pages=sched.allocator.alloc(sched.workers.pages_needed(len(p) + new)))
        first = sched.workers.forward([SeqChunk(p, 0, r.pages)])[0][-1].argmax()
        sched._commit(r, [int(first)], first=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = clock()
    while sched.running:
        sched._decode()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = clock() - t0
    outs: dict[int, list[int]] = {}
    verify = 0
    for ev in sent:
        outs.setdefault(ev.room, []).extend(ev.token_ids)
        verify += len(ev.spec_accept)
    return dt, len(prompts) * (new - 1), verify, [outs[i] for i in range(len(prompts))]


def oracle(sched: DecodeScheduler, prompts: list[list[int]], want: list[list[int]]) -> None:
    """Replace the draft's proposals by the true greedy continuation."""
    truth = {len(p): w for p, w in zip(prompts, want)}

    def propose(blocks):
        rows = []
        for b in blocks:
            plen = max(n for n in truth if n <= b.start_pos)
            out = truth[plen]
            rows.append([out[j] if (j := b.start_pos + 1 + i - plen) < len(out) else 0
                         for i in range(b.block_size - 1)])
        return torch.tensor(rows)

    sched.workers.rank.runner.propose = propose


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--draft", help="a DFlash draft for the embedded model (default: a random one)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.device == "cpu":
        torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    model_dir = ensure_embedded_model(tmp / "cache")
    draft = Path(a.draft) if a.draft else write_random_draft(tmp / "draft", model_dir, seed=1, n_layers=2,
                                                           block_size=a.block)
    g = torch.Generator().manual_seed(0)
    print(f"device {a.device}, prompt {a.prompt} tokens, {a.new} new tokens, block {a.block}")
    print(f"{'batch':>5} | {'mode':<22} | {'tok/s':>8} | {'tau':>5} | speed-up vs off")
    for batch in a.batch:
        # Prompt lengths far enough apart that a block's position names its request (oracle()).
        prompts = [torch.randint(10, 4000, (a.prompt + (a.new + a.block) * i,), generator=g).tolist()
                   for i in range(batch)]
        ref = ModelRunner.from_dir(model_dir, page_size=16, num_pages=2048, device=a.device, dtype=torch.float32,
                                   progress=False)
        want = greedy_generate(ref, PageAllocator(2048), prompts, a.new, ignore_eos=True)
        del ref
        base = None
        for mode in ("off", "draft", "oracle proposals"):
            sched = scheduler(model_dir, None if mode == "off" else draft, a.device, a.block)
            try:
                if mode == "oracle proposals":
                    oracle(sched, prompts, want)
                decode_run(sched, prompts, 8)  # warm-up
                dt, toks, verify, outs = decode_run(sched, prompts, a.new)
            finally:
                sched.close()
            assert outs == want, f"{mode}: output differs from plain greedy"
            rate = toks / dt
            base = base or rate
            tau = f"{toks / verify:.2f}" if verify else "-"
            print(f"{batch:>5} | {mode:<22} | {rate:8.1f} | {tau:>5} | {rate / base:.2f}x")


if __name__ == "__main__":
    main()

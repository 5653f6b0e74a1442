"""Pipeline-parallel prefill's time to first token against prompt length (`ttft_table`), on the
server's own prefill ranks (`workers`: `ProcessWorkers`, gloo rank processes, one thread each; on
CUDA GPUs 0 .. pp − 1) driven the way the prefill scheduler drives them (`prefill`): per step one
micro-batch per stage, each one chunk of the prompt; TTFT here is the wall time of the prompt's
steps (no router, no transfer). Beside it, the stages' summed busy time (compute only, waiting for
the previous stage excluded: wall / busy below 1.0 means stages ran at the same time) and the
bytes each stage boundary carries per token. Used by benchmarks/pp_cpu.py and benchmarks/gpu_pp.py.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from glm53.models import GlmConfig, PageAllocator, SeqChunk
from glm53.server.config_parse import parse_config
from glm53.server.engine.group import LocalWorkers
from glm53.server.engine.processes import ProcessWorkers
from glm53.server.engine.worker import rank_specs
from glm53.support.ports import free_ports
from glm53.transport import BootstrapServer


def workers(model_dir: Path, draft: Path | None, pp: int, pages: int, device: str = "cpu",
            dtype: str = "float32", page_size: int = 16):
    """A prefill instance's ranks (and its bootstrap server): pp stages, on CUDA GPUs 0 .. pp − 1."""
    ports = free_ports(4)
    gpus = {"devices": list(range(pp))} if device == "cuda" else {}
    cfg = parse_config({
        "model": {"path": str(model_dir)},
        **({"speculative": {"algorithm": "DFLASH", "draft_model_path": str(draft)}} if draft else {}),
        "defaults": {"device": device, "dtype": dtype, "page_size": page_size, "num_pages": pages},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1], "pp": pp, **gpus}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2], **({"devices": [0]} if gpus else {})}],
    })
    inst = cfg.prefill[0]
    boot = BootstrapServer("p0", pp_size=pp, tp_size=1, host="127.0.0.1", port=inst.bootstrap_port)
    specs = rank_specs(cfg, inst, str(model_dir), GlmConfig.from_dir(model_dir).num_hidden_layers)
    return boot, (LocalWorkers(specs) if pp == 1 else ProcessWorkers(specs, timeout_s=120, port=ports[3]))


def prefill(w, prompt: list[int], pages: list[int], chunk: int, pp: int) -> float:
    """Wall time of the prompt's steps up to its first token (read on the host, as prefill samples it)."""
    chunks = [SeqChunk(prompt[i : i + chunk], i, pages) for i in range(0, len(prompt), chunk)]
    t0 = time.perf_counter()
    for s in range(0, len(chunks), pp):  # a step: one micro-batch per stage
        logits = w.forward_microbatches([[c] for c in chunks[s : s + pp]])
    int(logits[-1][0][-1].argmax())
    return time.perf_counter() - t0


def ttft_table(model_dir: Path, draft: Path | None, lengths: list[int], pps: list[int], chunk: int, repeat: int,
               device: str = "cpu", dtype: str = "float32", page_size: int = 16) -> list[dict]:
    """Prints and returns, per (pp, prompt length): TTFT (median of `repeat` after a warm-up), the
    speed-up over pp = 1, the stages' summed busy time and the bytes each boundary carried per token."""
    pages = -(-max(lengths) // page_size) + 1
    g = torch.Generator().manual_seed(0)
    vocab = GlmConfig.from_dir(model_dir).vocab_size
    prompts = {n: torch.randint(10, vocab - 10, (n,), generator=g).tolist() for n in lengths}
    print(f"{model_dir.name}, {device}, chunk {chunk}, dflash {draft is not None}, median of {repeat}")
    print(f"{'pp':>3} | {'prompt':>6} | {'TTFT ms':>8} | {'vs pp=1':>7} | {'stage busy ms (sum)':>20} | "
          f"{'wall/busy':>9} | boundary B/token")
    base: dict[int, float] = {}
    rows = []
    for pp in pps:
        boot, w = workers(model_dir, draft, pp, pages, device, dtype, page_size)
        try:
            alloc = PageAllocator(w.num_pages)
            for n, prompt in prompts.items():
                pg = alloc.alloc(-(-n // page_size))
                prefill(w, prompt, pg, chunk, pp)  # warm-up
                walls, busy = [], []
                for _ in range(repeat):
                    before = [st.busy_s if st else 0.0 for st in getattr(w, "stage_stats", [])] or [0.0]
                    walls.append(prefill(w, prompt, pg, chunk, pp))
                    after = [st.busy_s if st else 0.0 for st in getattr(w, "stage_stats", [])] or [0.0]
                    busy.append(sum(x - y for x, y in zip(after, before)))
                alloc.free(pg)
                wall = statistics.median(walls)
                base.setdefault(n, wall)
                stats = [st for st in getattr(w, "stage_stats", []) if st and st.tokens]
                per_token = [st.bytes / st.tokens for st in stats]
                b = statistics.median(busy)
                ratio = f"{wall / b:.2f}" if pp > 1 and b else "-"
                busy_txt = f"{b * 1e3:.0f}" if pp > 1 else "-"
                print(f"{pp:>3} | {n:>6} | {wall * 1e3:8.0f} | {base[n] / wall:6.2f}x | {busy_txt:>20} | "
                      f"{ratio:>9} | {' / '.join(f'{x:.0f}' for x in per_token) or '-'}", flush=True)
                rows.append({"pp": pp, "prompt": n, "ttft_s": wall, "speedup": base[n] / wall, "ideal": pp,
                             "busy_s": b if pp > 1 else None, "boundary_bytes_per_token": per_token})
        finally:
            w.close()
            boot.close()
    return rows

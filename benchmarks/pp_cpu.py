"""Pipeline-parallel prefill on the CPU: time to first token against prompt length for pp = 1, 2,
4, whether the stages overlap, and the bytes each stage boundary carries per token, in one run.

    PYTHONPATH=. python benchmarks/pp_cpu.py [--lengths 512 1024 2048] [--pp 1 2 4] [--chunk 128]

The prefill ranks are the server's own (`ProcessWorkers`, gloo rank processes, one thread each),
driven the way the prefill scheduler drives them: per step one micro-batch per stage, each one
chunk of the prompt; TTFT here is the wall time of the prompt's steps (no router, no transfer).
"Overlap" compares that wall time with the sum of the stages' busy times (compute only, waiting
for the previous stage excluded): below 1.0 means stages ran at the same time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from glm53.models import GlmConfig, PageAllocator, SeqChunk, write_random_draft
from glm53.server.config import parse_config
from glm53.server.embedded_model import ensure_embedded_model
from glm53.server.engine.group import LocalWorkers
from glm53.server.engine.processes import ProcessWorkers
from glm53.server.engine.worker import rank_specs
from glm53.transport import BootstrapServer
from tests.net import free_ports


def workers(model_dir: Path, draft: Path | None, pp: int, pages: int):
    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": str(model_dir)},
        **({"speculative": {"algorithm": "DFLASH", "draft_model_path": str(draft)}} if draft else {}),
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": 16, "num_pages": pages},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1], "pp": pp}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })
    inst = cfg.prefill[0]
    boot = BootstrapServer("p0", pp_size=pp, tp_size=1, host="127.0.0.1", port=inst.bootstrap_port)
    specs = rank_specs(cfg, inst, str(model_dir), GlmConfig.from_dir(model_dir).num_hidden_layers)
    return boot, (LocalWorkers(specs) if pp == 1 else ProcessWorkers(specs, timeout_s=120, port=ports[3]))


def prefill(w, prompt: list[int], pages: list[int], chunk: int, pp: int) -> float:
    chunks = [SeqChunk(prompt[i : i + chunk], i, pages) for i in range(0, len(prompt), chunk)]
    t0 = time.perf_counter()
    for s in range(0, len(chunks), pp):  # a step: one micro-batch per stage
        w.forward_microbatches([[c] for c in chunks[s : s + pp]])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dflash", action="store_true", help="with a random DFlash draft (partial projection)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="pp-bench-"))
    model_dir = ensure_embedded_model(tmp / "cache")
    draft = write_random_draft(tmp / "draft", model_dir, n_layers=2, block_size=4) if a.dflash else None
    pages = -(-max(a.lengths) // 16) + 1
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(10, 4000, (n,), generator=g).tolist() for n in a.lengths}
    print(f"embedded model, chunk {a.chunk}, dflash {a.dflash}, median of {a.repeat}")
    print(f"{'pp':>3} | {'prompt':>6} | {'TTFT ms':>8} | {'vs pp=1':>7} | {'stage busy ms (sum)':>20} | "
          f"{'wall/busy':>9} | boundary B/token")
    base: dict[int, float] = {}
    for pp in a.pp:
        boot, w = workers(model_dir, draft, pp, pages)
        try:
            alloc = PageAllocator(w.num_pages)
            for n, prompt in prompts.items():
                pg = alloc.alloc(-(-n // 16))
                prefill(w, prompt, pg, a.chunk, pp)  # warm-up
                walls, busy = [], []
                for _ in range(a.repeat):
                    before = [st.busy_s if st else 0.0 for st in getattr(w, "stage_stats", [])] or [0.0]
                    walls.append(prefill(w, prompt, pg, a.chunk, pp))
                    after = [st.busy_s if st else 0.0 for st in getattr(w, "stage_stats", [])] or [0.0]
                    busy.append(sum(x - y for x, y in zip(after, before)))
                alloc.free(pg)
                wall = statistics.median(walls)
                base.setdefault(n, wall)
                stats = [st for st in getattr(w, "stage_stats", []) if st and st.tokens]
                per_token = "-" if not stats else " / ".join(f"{st.bytes / st.tokens:.0f}" for st in stats)
                b = statistics.median(busy)
                ratio = f"{wall / b:.2f}" if pp > 1 and b else "-"
                busy_txt = f"{b * 1e3:.0f}" if pp > 1 else "-"
                print(f"{pp:>3} | {n:>6} | {wall * 1e3:8.0f} | {base[n] / wall:6.2f}x | {busy_txt:>20} | "
                      f"{ratio:>9} | {per_token}")
        finally:
            w.close()
            boot.close()


if __name__ == "__main__":
    main()

"""MTP (NextN) step time, eager vs CUDA graph, of a model with its MTP layer alone (no serving
around it): the time of `ModelRunner.spec_step` with the NEXTN draft (catch-up, chained
proposals, verify, the kept hidden rows, and the host reading the drafts and verify argmaxes), as
the decode scheduler calls it.

    PYTHONPATH=. python benchmarks/mtp_steps.py --model DIR [--sizes 1 16 64] [--ctx 3968]
        [--steps 3] [--iters 12] [--sampled]

Contexts of `--ctx` tokens per request with random KV in every pool; each request drafts from
its first step (a random seed row, as prefill sends it) and commits one token per step, so every
step catches up one row (this times the step, not τ). `--sampled`: the requests draft by sampling
(the sampled graphs). Median over the steps after the first three.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from glm53.models import DraftBlock, ModelRunner
from glm53.models.draft import DraftSampling
from glm53.models.graph import GraphConfig
from glm53.support.step_timing import median_step_ms

PS = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint with its MTP layer")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ctx", type=int, default=3968)
    ap.add_argument("--steps", type=int, default=3, help="proposals chained per verify (num_steps)")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: the eager rows only (a smoke test of the script)")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.set_grad_enabled(False)
    k = a.steps + 1
    need = -(-(a.ctx + a.iters + k) // PS)  # pages per request
    cfg = GraphConfig(max_bs=max(a.sizes), max_context=need * PS) if gpu else None
    base = ModelRunner.from_dir(a.model, page_size=PS, num_pages=1, device=a.device, progress=False,
                                nextn_steps=a.steps)
    t0 = time.perf_counter()
    runner = ModelRunner(base.model, num_pages=need * max(a.sizes) + 1, page_size=PS, device=a.device,
                         mtp=base.mtp, graphs=cfg)
    capture_s = time.perf_counter() - t0
    graphs = runner.mtp_graphs
    print(f"model {a.model.name}, dtype {base.model.dtype}, {a.steps} steps, context {a.ctx}: "
          + (f"{len(graphs.graphs)} MTP step graphs (batch {list(graphs.sizes)}, widths {list(graphs.widths)} "
             f"pages, greedy and sampled) captured in {capture_s:.1f} s" if gpu else "eager only"), flush=True)
    for _, pool in runner.pools:
        pool.tensor.normal_()
    hidden = runner.cfg.hidden_size
    rows = []
    for bs in a.sizes:
        tables = [list(range(i * need, (i + 1) * need)) for i in range(bs)]
        for mode in ("graph", "eager") if gpu else ("eager",):
            runner.mtp_graphs = graphs if mode == "graph" else None
            runner.mtp.state = {}
            toks = [1] * bs

            def step(it: int) -> None:
                nonlocal toks
                blocks = []
                for i in range(bs):
                    seed = torch.randn(hidden, device=a.device).to(base.model.dtype) if it == 0 else None
                    samp = DraftSampling(0.8, 0, 0.95, 0.0, seed=it * bs + i) if a.sampled else None
                    blocks.append(DraftBlock(toks[i], a.ctx + it, tables[i], block_size=k, key=i, sampling=samp,
                                             seed_hidden=seed))
                out = runner.spec_step(blocks)
                toks = [g[0] for g in out.greedy]

            before = graphs.replays if gpu else 0
            ms = median_step_ms(step, a.iters, sync)
            assert not gpu or (graphs.replays > before) == (mode == "graph")
            rows.append({"bs": bs, "mode": mode, "steps": a.steps, "sampled": a.sampled, "ms": ms})
            print(f"mtp step bs {bs:3d} steps {a.steps} {'sampled' if a.sampled else 'greedy':7s} {mode:5s}: "
                  f"{ms:7.2f} ms", flush=True)
        runner.mtp_graphs = graphs
    if a.json:
        a.json.write_text(json.dumps({"capture_s": capture_s, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

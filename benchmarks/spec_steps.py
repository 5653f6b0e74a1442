"""DFlash step time, eager vs CUDA graph, of a model and a draft alone (no serving around it): the
time of `ModelRunner.spec_step` (propose, verify, draft context write, and the host reading the
drafts and verify argmaxes), as the decode scheduler calls it; with `--plain`, also the plain
decode step (graph and eager) of the same model for comparison.

    PYTHONPATH=. python benchmarks/spec_steps.py --model SLICE --draft DRAFT [--sizes 1 64] [--ctx 3968]
        [--block 4] [--iters 12]

Contexts of `--ctx` tokens per request with random KV in every pool (realistic indexer scores, no
all-tie top-k); each step commits one token per request (a random draft is rarely accepted: this
times the step, not τ). Median over the steps after the first three.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from glm53.models import DraftBlock, ModelRunner, SeqChunk
from glm53.models.graph import GraphConfig
from glm53.support.step_timing import median_step_ms

PS = 64


def kernels(title: str, step, steps: int, positions: int) -> float:
    """Profiles `steps` steps (at positions cycling through the first `positions` the timing
    used); prints the GPU kernel time per step and its largest kernels."""
    from glm53.support.kernel_profile import kernel_table, print_table, profile

    it = itertools.count()
    prof = profile(lambda: step(next(it) % positions), steps)
    gpu_us, table = kernel_table(prof, steps, 15)
    print_table(title, gpu_us, table)
    return gpu_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=3968)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--plain", action="store_true", help="also time the plain decode step")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="GPU: also profile this many graph steps of each kind and print their kernels")
    ap.add_argument("--device", default="cuda", help="cpu: the eager rows only (a smoke test of the script)")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.set_grad_enabled(False)
    k = a.block
    need = -(-(a.ctx + a.iters + k) // PS)  # pages per request
    cfg = GraphConfig(max_bs=max(a.sizes), max_context=need * PS, block=k) if gpu else None
    base = ModelRunner.from_dir(a.model, page_size=PS, num_pages=1, device=a.device, progress=False,
                                draft_dir=a.draft)
    t0 = time.perf_counter()
    runner = ModelRunner(base.model, num_pages=need * max(a.sizes) + 1, page_size=PS, device=a.device,
                         draft=base.draft, graphs=cfg)
    capture_s = time.perf_counter() - t0
    graphs = runner.spec_graphs
    print(f"model {a.model.name}, draft {a.draft.name}, dtype {base.model.dtype}, block {k}, context {a.ctx}: "
          + (f"{len(graphs.graphs)} DFlash step graphs (batch {list(graphs.sizes)}, widths {list(graphs.widths)} "
             f"pages) captured in {capture_s:.1f} s" if gpu else "eager only"), flush=True)
    for _, pool in runner.pools:
        pool.tensor.normal_()
    rows = []
    for bs in a.sizes:
        tables = [list(range(i * need, (i + 1) * need)) for i in range(bs)]
        for mode in ("graph", "eager") if gpu else ("eager",):
            runner.spec_graphs = graphs if mode == "graph" else None
            toks = [1] * bs

            def step(it: int) -> None:
                nonlocal toks
                blocks = [DraftBlock(toks[i], a.ctx + it, tables[i], block_size=k) for i in range(bs)]
                out = runner.spec_step(blocks)
                toks = [g[0] for g in out.greedy]

            before = graphs.replays if gpu else 0
            ms = median_step_ms(step, a.iters, sync)
            assert not gpu or (graphs.replays > before) == (mode == "graph")
            rows.append({"kind": "dflash", "bs": bs, "mode": mode, "block": k, "ms": ms})
            print(f"dflash step  bs {bs:3d} block {k} {mode:5s}: {ms:7.2f} ms", flush=True)
            if a.profile and mode == "graph":
                rows[-1]["gpu_us"] = kernels(f"dflash step bs {bs} block {k}", step, a.profile, a.iters)
        runner.spec_graphs = graphs
    if a.plain and gpu:
        t0 = time.perf_counter()
        plain = ModelRunner(base.model, num_pages=need * max(a.sizes), page_size=PS, device="cuda",
                            graphs=GraphConfig(max_bs=max(a.sizes), max_context=need * PS))
        print(f"plain decode graphs captured in {time.perf_counter() - t0:.1f} s", flush=True)
        for _, pool in plain.pools:
            pool.tensor.normal_()
        dec = plain.graphs
        for bs in a.sizes:
            tables = [list(range(i * need, (i + 1) * need)) for i in range(bs)]
            for mode in ("graph", "eager"):
                plain.graphs = dec if mode == "graph" else None
                toks = [1] * bs

                def step(it: int) -> None:
                    nonlocal toks
                    logits = plain.forward([SeqChunk([toks[i]], a.ctx + it, tables[i]) for i in range(bs)])
                    toks = torch.cat(logits).argmax(-1).tolist()

                ms = median_step_ms(step, a.iters, sync)
                rows.append({"kind": "plain", "bs": bs, "mode": mode, "ms": ms})
                print(f"plain decode bs {bs:3d}         {mode:5s}: {ms:7.2f} ms", flush=True)
                if a.profile and mode == "graph":
                    rows[-1]["gpu_us"] = kernels(f"plain decode bs {bs}", step, a.profile, a.iters)
            plain.graphs = dec
    if a.json:
        a.json.write_text(json.dumps({"capture_s": capture_s, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Kernel launches of one decode step on the GPU code path, counted on a CPU: a GPU step at small
batch is launch-bound (each small kernel a few µs of a graph replay), so the count is the figure a
change to it moves before a GPU can time it.

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/launch_census.py --model assets/tiny-glm5 \\
        [--draft assets/tiny-glm5-dspark] [--threshold 0.2] [--fp8] [--dtype bfloat16] [--sites]

Under the Triton interpreter the dispatch picks every Triton kernel for CPU tensors, so the step
runs the code a GPU runs: `DecodeGraphs.run_eager`'s body (the plain step), and with `--draft`
also `spec_graph.spec_forward` (the speculative step the graphs hold, block = the draft's). It
counts each Triton launch and each torch op that would launch a kernel (one that writes memory:
views, allocations and no-op casts excluded; on a GPU a torch op is one launch or, rarely, a
few). `--sites` adds the counts by the glm53 line that made them. Before/after: run it in both
trees (PYTHONPATH). Numbers: benchmarks/history/2026-12-05.md (twenty-fifth session).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import pkgutil
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FREE = {"empty", "empty_like", "new_empty", "empty_strided", "detach", "detach_", "set_", "lift_fresh",
        "_local_scalar_dense"}


def _site(skip_kernels: bool) -> str:
    for f in reversed(traceback.extract_stack()[:-2]):
        if "glm53" in f.filename and not (skip_kernels and f.filename.endswith("_triton.py")):
            return f"{Path(f.filename).name}:{f.lineno} {f.name}"
    return "?"


class Census(TorchDispatchMode):
    """Counts torch ops that launch (outside Triton launches, whose own tensor traffic under the
    interpreter is not the GPU's) and, once `hook_triton` ran, Triton launches."""

    def __init__(self):
        super().__init__()
        self.torch_ops: collections.Counter = collections.Counter()
        self.triton: collections.Counter = collections.Counter()
        self.sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if self.inside or name in FREE:
            return out
        leaves = torch.utils._pytree.tree_leaves
        ins = {a.untyped_storage().data_ptr() for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        outs = [o for o in leaves(out) if isinstance(o, torch.Tensor)]
        aliased = bool(outs) and all(o.untyped_storage().data_ptr() in ins for o in outs)
        if name.endswith("_") or (outs and not aliased):
            self.torch_ops[name] += 1
            self.sites[_site(False)][name] += 1
        return out

    def triton_launch(self, run, name: str, args, kwargs):
        if not self.inside:
            self.triton[name] += 1
            self.sites[_site(True)][name] += 1
        outer, self.inside = self.inside, True
        try:
            return run(*args, **kwargs)
        finally:
            self.inside = outer

    def report(self, title: str, sites: bool) -> None:
        t, o = sum(self.triton.values()), sum(self.torch_ops.values())
        print(f"{title}: {t + o} launches = {t} Triton + {o} torch")
        print("  Triton:", ", ".join(f"{k} {v}" for k, v in self.triton.most_common()))
        print("  torch: ", ", ".join(f"{k} {v}" for k, v in self.torch_ops.most_common()))
        if sites:
            for site, c in sorted(self.sites.items()):
                print(f"    {site}: " + ", ".join(f"{k} {v}" for k, v in c.items()))


ACTIVE: list[Census] = []  # the census counting now (the Triton hooks report to it)


def hook_triton() -> None:
    """Every glm53 Triton kernel's launches go through the active census."""
    import glm53.kernels as pkg

    def counted(run, name):
        def launch(*args, **kwargs):
            return ACTIVE[-1].triton_launch(run, name, args, kwargs) if ACTIVE else run(*args, **kwargs)
        return launch

    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"glm53.kernels.{info.name}")
        for fn in vars(mod).values():
            if hasattr(fn, "fn") and hasattr(fn, "run") and fn.fn.__name__.endswith("_kernel"):
                fn.run = counted(fn.run, fn.fn.__name__)


def census(step, title: str, sites: bool) -> None:
    step()  # once before: caches built on first use (stacked weights, fused products) are not a step's
    c = Census()
    ACTIVE.append(c)
    try:
        with c:
            step()
    finally:
        ACTIVE.pop()
    c.report(title, sites)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--fp8", action="store_true", help="keep block-FP8 weights FP8 (a GLM-5-FP8-layout checkpoint)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=900, help="the request's position")
    ap.add_argument("--threshold", type=float, default=0.0, help="a DSpark draft's confidence cut (0: none)")
    ap.add_argument("--sites", action="store_true")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run under TRITON_INTERPRET=1: the GPU code path on CPU tensors")
    from glm53.models import ModelRunner, SeqChunk
    from glm53.models.decode_state import DecodeState
    from glm53.models.graph import GraphConfig
    from glm53.models.spec_graph import SpecGraphs

    torch.set_grad_enabled(False)
    ps, pages = 64, -(-(a.context + 64) // 64)
    dtype = getattr(torch, a.dtype)
    plain = ModelRunner.from_dir(a.model, page_size=ps, num_pages=pages + 1, progress=False, fp8=a.fp8, dtype=dtype)
    state = DecodeState(1, pages, ps, pages, plain.cfg.max_position_embeddings, "cpu")
    state.update([SeqChunk([5], a.context, list(range(pages)))])

    def plain_step():
        batch = state.batch(1, pages, plain.model.inv_freq)
        plain.model.logits(plain.model.forward_stage(batch, plain.pools, None).hidden)

    hook_triton()
    census(plain_step, "plain decode step, batch 1", a.sites)
    if a.draft is not None:
        r = ModelRunner.from_dir(a.model, page_size=ps, num_pages=pages + 1, progress=False, fp8=a.fp8, dtype=dtype,
                                 draft_dir=a.draft, confidence_threshold=a.threshold)
        k = r.draft.cfg.block_size
        graphs = SpecGraphs(r, GraphConfig(max_bs=1, max_context=pages * ps, block=k), pad_page=pages, capture=False)
        from glm53.models import DraftBlock

        rows, key = graphs.bucket([DraftBlock(5, a.context, list(range(pages)), block_size=k)])
        graphs.state.update(rows)
        census(lambda: graphs.run_eager(*key), f"speculative step, batch 1, block {k}", a.sites)


if __name__ == "__main__":
    main()

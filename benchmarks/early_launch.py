"""The FP8 slice's decode step under the switches that launch kernels early (`kernels/launch_early`):
the small kernels (`SMALL_KERNELS`), the W_UV product (`fp8_act.UV_PDL`, `UV_PREFETCH`) and the MoE
down kernel (`moe_fp8_triton.DOWN_PDL`, `DOWN_PREFETCH`); and the attention's ops off the main chain
on a side stream (`models.overlap.SIDE_STREAM`); and the W_UV product combining the attention's
splits in its own launch (`fp8_act.UV_SPLITS_MAX_ROWS`: `splits` at every size, `rows4` at up to 4
rows); and the indexer's query product, logits and top-k ahead of q_b and the absorbed query
(`overlap.INDEX_FIRST_MAX_ROWS`); and the main chain's stream priority (`overlap.MAIN_PRIORITY`;
`shipped`: every switch as shipped). Each variant's step is
captured as the serving graphs capture it and timed as one CUDA graph replayed back to back (the
step's GPU time, no host work between steps), the variants interleaved over `--rounds` so drift
hits all of them; the logits of every variant are checked equal to the all-off step's. Prints
each variant's median and its ratio to all-off; `--trace V[,W]` adds those variants' kernels in
order with the gaps between them.

    python3 benchmarks/early_launch.py [--sizes 1 64] [--rounds 2] [--trace off] [--json out.json]
        [--variants off,small,uv,down,all,side,every,splits,every+splits,every+rows4,shipped]
    (a GPU of compute capability 9.0+)
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# The constants each variant sets, in the order of its tuple.
SWITCHES = (("glm53.kernels.launch_early", "SMALL_KERNELS"), ("glm53.kernels.fp8_act", "UV_PDL"),
            ("glm53.kernels.fp8_act", "UV_PREFETCH"), ("glm53.kernels.moe_fp8_triton", "DOWN_PDL"),
            ("glm53.kernels.moe_fp8_triton", "DOWN_PREFETCH"), ("glm53.models.overlap", "SIDE_STREAM"),
            ("glm53.kernels.fp8_act", "UV_SPLITS_MAX_ROWS"), ("glm53.models.overlap", "INDEX_FIRST_MAX_ROWS"),
            ("glm53.models.overlap", "MAIN_PRIORITY"))
ANY = 1 << 30  # the W_UV product takes the splits at every size
VARIANTS = {
    "off": (False, False, 0, False, 0, False, 0, 0, 0),
    "small": (True, False, 0, False, 0, False, 0, 0, 0),
    "uv": (False, True, 1024, False, 0, False, 0, 0, 0),
    "uv256": (False, True, 256, False, 0, False, 0, 0, 0),
    "down": (False, False, 0, True, 256, False, 0, 0, 0),
    "down0": (False, False, 0, True, 0, False, 0, 0, 0),
    "all": (True, True, 1024, True, 256, False, 0, 0, 0),
    "side": (False, False, 0, False, 0, True, 0, 0, 0),
    "every": (True, True, 1024, True, 256, True, 0, 0, 0),
    "splits": (False, False, 0, False, 0, False, ANY, 0, 0),  # the W_UV product combines the attention's splits
    "every+splits": (True, True, 1024, True, 256, True, ANY, 0, 0),
    "every+rows4": (True, True, 1024, True, 256, True, 4, 0, 0),  # the shipped switches before index-first
    # the modules' constants as this import finds them, before any switch: never a copy that drifts
    "shipped": tuple(getattr(importlib.import_module(m), a) for m, a in SWITCHES),
}


def switch(name: str) -> None:
    for (module, attr), value in zip(SWITCHES, VARIANTS[name], strict=True):
        setattr(importlib.import_module(module), attr, value)


def step_graphs(base, sizes: list[int], ctx: int):
    """A runner whose decode graphs are captured under the current switches, and per batch size its
    graph after three steps at position `ctx` (random KV) with the last step's logits."""
    from glm53.models import ModelRunner, SeqChunk
    from glm53.models.graph import GraphConfig

    need = -(-(ctx + 64) // 64)
    runner = ModelRunner(base.model, num_pages=need * max(sizes), page_size=64, device="cuda",
                         graphs=GraphConfig(max_bs=max(sizes), max_context=need * 64))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _, pool in runner.pools:
        pool.tensor.normal_(generator=gen)
    out = {}
    for bs in sizes:
        toks = [1] * bs
        for it in range(3):
            chunks = [SeqChunk([toks[i]], ctx + it, list(range(i * need, (i + 1) * need))) for i in range(bs)]
            logits = torch.cat(runner.forward(chunks))
            toks = logits.argmax(-1).tolist()
        out[bs] = (runner.graphs.graphs[runner.graphs.bucket(chunks)][0], logits)
    return runner, out


def trace(graph) -> list[str]:
    """The kernels of one replay in order: start (µs from the first kernel's), duration, the gap
    since the previous one ended and the stream (where two streams overlap, which kernel waited
    on which shows in the starts)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    n = len(ev) // 3
    ev = ev[n:2 * n]  # the middle replay
    t0 = ev[0].time_range.start
    end, gaps, rows = t0, 0.0, []
    for e in ev:
        gap = e.time_range.start - end
        gaps += max(gap, 0.0)
        rows.append(f"  @{e.time_range.start - t0:7.1f}  {e.time_range.elapsed_us():7.1f} us  gap {gap:6.1f}  "
                    f"s{getattr(e, 'device_resource_id', '?')}  {e.name[:90]}")
        end = max(end, e.time_range.end)
    rows.append(f"  {len(ev)} kernels, span {end - t0:.1f} us, gaps {gaps:.1f} us "
                "(a kernel launched early starts before the one before it ends: a negative gap)")
    return rows


def step_ab(base, sizes: list[int], rounds: int, context: int, settings: dict[str, Callable[[], None]],
            exact: bool = False, traced: Sequence[str] = ()) -> list[dict]:
    """The decode step's graph (`step_graphs`) replayed under each setting (name -> a function that
    applies it; the first is the baseline), the settings interleaved over `rounds` so drift hits all
    of them. Prints each replay and, per batch size, each setting's median and its ratio to the
    first's. `exact`: the logits must equal the first setting's (else their relative difference is
    printed: a setting may sum in another order); `traced`: the settings whose first size's step
    kernels are listed (round 0). Returns the rows of that report."""
    from glm53.support.kernel_profile import replay_us

    names = list(settings)
    times: dict[tuple[str, int], list[float]] = {}
    ref: dict[int, torch.Tensor] = {}
    for r in range(rounds):
        for name in names:
            settings[name]()
            runner, steps = step_graphs(base, sizes, context)
            for bs, (graph, logits) in steps.items():
                ref.setdefault(bs, logits)
                if exact:
                    same = torch.equal(logits, ref[bs])
                    note = "" if same else "  LOGITS DIFFER"
                else:
                    from benchmarks.fp8_gemm import rel

                    same, note = True, f"  logits rel diff {rel(logits.float(), ref[bs].float()):.1e}"
                us = statistics.median(replay_us(graph, 50) for _ in range(7))
                times.setdefault((name, bs), []).append(us)
                print(f"round {r} {name:8s} bs {bs:3d}: {us:8.1f} us/step{note}", flush=True)
                assert same, f"{name}: the logits differ from the {names[0]} step's"
            if name in traced and r == 0:
                print(f"{name}, batch {sizes[0]}, one replay:\n" + "\n".join(trace(steps[sizes[0]][0])), flush=True)
            del runner, steps
            torch.cuda.empty_cache()
    report = []
    for bs in sizes:
        first = statistics.median(times[names[0], bs])
        for name in names:
            med = statistics.median(times[name, bs])
            report.append({"setting": name, "bs": bs, "us": med, "runs": times[name, bs], "vs_first": med / first})
            print(f"bs {bs:3d} {name:8s}: {med:8.1f} us/step  {med / first:.3f}x {names[0]}  "
                  f"(runs {', '.join(f'{t:.1f}' for t in times[name, bs])})", flush=True)
    return report


def step_args(ap: argparse.ArgumentParser, sizes: list[int]) -> None:
    """The arguments of a benchmark that times the slice's decode step: --slice, --sizes,
    --context, --rounds, --json."""
    ap.add_argument("--slice", type=Path, default=Path("/tmp/glm5-slice-fp8"))
    ap.add_argument("--sizes", type=int, nargs="+", default=sizes)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)


def slice_runner(path: Path):
    """The FP8 slice (written first if missing) in a runner on the GPU: the weights the step
    graphs share (`step_graphs`)."""
    from glm53.models import ModelRunner
    from glm53.support.glm5_slice import ensure_slice

    return ModelRunner.from_dir(ensure_slice(path, fp8=True), page_size=64, num_pages=1, device="cuda",
                                progress=False, fp8=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_args(ap, [1, 64])
    ap.add_argument("--variants", default="off,small,uv,down,all")
    ap.add_argument("--trace", default="", help="variants (comma-separated) whose first size's step kernels to list")
    a = ap.parse_args()
    names = a.variants.split(",")
    assert names[0] == "off" and all(n in VARIANTS for n in names), f"variants: off first, of {sorted(VARIANTS)}"
    print(torch.cuda.get_device_name(), flush=True)
    base = slice_runner(a.slice)
    settings = {name: (lambda n=name: switch(n)) for name in names}
    report = step_ab(base, a.sizes, a.rounds, a.context, settings, exact=True, traced=a.trace.split(","))
    switch("off")
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "context": a.context,
                                      "results": report}, indent=1))


if __name__ == "__main__":
    main()

"""τ and decode speed of a trained target + DFlash draft on held-out Python code, through the
decode scheduler's real loop (DFlash off vs on, greedy; the outputs must be identical).

    PYTHONPATH=. python tools/eval_dflash.py --model DIR --draft DIR [DIR ...] [--device cpu|cuda] [--batch 1 16]
        [--new 128] [--block 4 8 16] [--repeat 1] [--singles 1] [--clock wall|cpu] [--graphs on|off|both]
        [--context N] [--package httpx] [--e2e] [--threshold T] [--steady K] [--overlap on|off|both]

Several `--draft`s (DFlash or DSpark: the algorithm follows the checkpoint; `--threshold` is a
DSpark draft's confidence cut) each get a row per block size, named by their directory.
`--package NAME`: prompts from the middle of that installed third-party package's source files
(glm53/support/corpus.package_prompts) instead of held-out stdlib files. `--e2e`: the timed span
includes the prompts' prefill forwards (with a draft, which also write its context KV).

Prompts: the first `--prompt` tokens of held-out standard-library files (the split of
glm53/support/corpus.py: sha1 of the path relative to the stdlib < 5 %), longer than index_topk so
decoding runs the sparse path. τ = tokens committed per verify step (≤ block size). With
`--repeat N` the off and DFlash runs alternate N times (on a shared, noisy CPU the ratio of
neighbouring runs is steadier than either rate); the table shows the median rate of each.
`--singles N`: batch 1 decodes N prompts one after the other (τ and rates over all of them);
`--clock cpu` times the decode loop by this thread's CPU time instead of wall time (torch runs
one thread here), which leaves out the time other jobs on a shared CPU took.

Per row also: decode steps, requests per step (batch 16 without `--steady`: all 16 start
together and, with a draft, end at different steps, so the batch thins out at the end while
plain decoding keeps all 16 to the last step), ms per step, and with a draft the host ms per step
outside `WorkerGroup.spec_step` (the scheduler's own work around the step). `--steady K`: a
batch B > 1 decodes K·B prompts with at most B at once, the next joining as one finishes (a
server's steady batch, glm53/support/decode_loop.decode_run's `running`).

On CUDA, plain decoding (`off`) replays its CUDA graphs; `--graphs` says whether the DFlash modes
replay theirs (`on`, the default, as served), run eagerly (`off`), or both (`dflash N eager` rows
beside `dflash N`). Graphs are captured for batches up to the largest `--batch` and requests up to
`--context` tokens (default: the model's context length). `--overlap` says whether the DFlash
modes launch a graphed step before reading the one before it (`on`, the default, as served:
engine/overlap.py), run each step synchronously (`off`, rows named `... sync`), or both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from glm53.support.corpus import held_file_prompts, package_prompts
from glm53.support.decode_loop import decode_run, scheduler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--draft", type=Path, nargs="+", required=True)
    ap.add_argument("--package", help="prompts from this installed third-party package's source")
    ap.add_argument("--e2e", action="store_true", help="time the prefill forwards too")
    ap.add_argument("--threshold", type=float, default=0.0, help="DSpark drafts' confidence cut")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--block", type=int, nargs="+", default=[16])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--singles", type=int, default=1, help="batch 1: this many prompts, one at a time")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--graphs", choices=["on", "off", "both"], default="on", help="CUDA graphs of the DFlash step")
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="on",
                    help="overlapped speculative steps (graphed greedy rows)")
    ap.add_argument("--prefill-graphs", choices=["on", "off"], default="on",
                    help="CUDA: prompts of up to 256 tokens replay a prefill graph, as a prefill rank's do")
    ap.add_argument("--context", type=int, default=None, help="longest request the graphs hold (tokens)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steady", type=int, default=1, metavar="K",
                    help="batch B > 1: K*B prompts, at most B decoding at once (refilled as they finish)")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: after the table, one more batch-1 run of each mode under torch.profiler: GPU kernel "
                         "time and wall time per decode step")
    ap.add_argument("--profile-top", type=int, default=12, help="kernels listed per mode under --profile")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    n_prompts = max([b * a.steady for b in a.batch] + [a.singles])
    all_prompts = (package_prompts(a.model, a.package, n_prompts, a.prompt) if a.package
                   else held_file_prompts(a.model, n_prompts, a.prompt))
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    print(f"device {a.device}, {len(all_prompts)} {a.package or 'held-out stdlib'} prompts of {a.prompt} tokens, "
          f"{a.new} new tokens, {'end to end (prefill timed)' if a.e2e else 'decode only'}, "
          f"blocks {a.block}, {a.repeat} alternating repeat(s), {a.clock} clock"
          + (f", batch 1 over {a.singles} prompts one at a time" if a.singles > 1 else "")
          + (f", batch B over {a.steady}*B prompts refilled as they finish" if a.steady > 1 else ""))
    print(f"{'batch':>5} | {'mode':<15} | {'tok/s':>8} | {'tau':>5} | {'steps':>5} | {'req/step':>8} | "
          f"{'ms/step':>7} | {'host ms':>7} | speed-up vs off")
    for batch in a.batch:
        groups = [[p] for p in all_prompts[: a.singles]] if batch == 1 else [all_prompts[: batch * a.steady]]
        running = batch if batch > 1 and a.steady > 1 else None
        kinds = {"on": [True], "off": [False], "both": [False, True]}[a.graphs]
        overlaps = {"on": [True], "off": [False], "both": [False, True]}[a.overlap]
        modes = [("off", None, True, None, True)] + [
            (f"{d.name if len(a.draft) > 1 else 'dflash'} {b}" + ("" if g else " eager") + ("" if o else " sync"),
             b, g, d, o)
            for d in a.draft for b in a.block for g in kinds for o in overlaps]
        rates: dict[str, list[float]] = {m[0]: [] for m in modes}
        taus, ref, differs, loops = {}, None, set(), {}
        for _ in range(a.repeat):
            for mode, block, graphs, draft, overlap in modes:
                sched = scheduler(a.model, draft, a.device, block, graphs=graphs, max_running=max(a.batch),
                                  context=a.context, dtype=a.dtype, threshold=a.threshold, overlap=overlap,
                                  prefill_graphs=a.prefill_graphs == "on")
                dt = toks = verify = 0
                outs = []
                loop = {"steps": 0, "rows": 0, "spec_s": 0.0, "wall_s": 0.0}
                try:
                    decode_run(sched, groups[0][:batch], 8)  # warm-up
                    for ps in groups:
                        st: dict = {}
                        d, t, v, o = decode_run(sched, ps, a.new, clock, prefill=a.e2e, running=running, stats=st)
                        dt, toks, verify, outs = dt + d, toks + t, verify + v, outs + o
                        for key in loop:
                            loop[key] += st[key]
                finally:
                    sched.close()
                ref = outs if ref is None else ref
                if outs != ref:
                    differs.add(mode)
                rates[mode].append(toks / dt)
                taus[mode] = f"{toks / verify:.2f}" if verify else "-"
                loops[mode] = loop
        med = {m: statistics.median(r) for m, r in rates.items()}
        for mode, _, captured, _, _ in modes:
            ratios = [x / y for x, y in zip(rates[mode], rates["off"])]
            lp = loops[mode]  # the last repeat's decode loop, wall clock
            per = lp["wall_s"] / lp["steps"] * 1e3
            host = f"{(lp['wall_s'] - lp['spec_s']) / lp['steps'] * 1e3:7.3f}" if lp["spec_s"] else f"{'-':>7}"
            print(f"{batch:>5} | {mode:<15} | {med[mode]:8.1f} | {taus[mode]:>5} | {lp['steps']:>5} | "
                  f"{lp['rows'] / lp['steps']:8.1f} | {per:7.3f} | {host} | {statistics.median(ratios):.2f}x"
                  + (f" (per repeat {', '.join(f'{r:.2f}' for r in ratios)})" if a.repeat > 1 and mode != "off" else "")
                  + ("  OUTPUT DIFFERS FROM OFF" if mode in differs else "")
                  + ("  (CUDA graphs)" if captured and a.device == "cuda" else ""), flush=True)
    if a.profile and a.device == "cuda":
        profile_steps(a, all_prompts[0])


def profile_steps(a, prompt: list[int]) -> None:
    """Per mode, one batch-1 decode of `prompt` under torch.profiler: wall and GPU kernel time per
    decode step (a plain step, or a speculative step of the first draft), and the largest kernels."""
    from glm53.support.kernel_profile import kernel_table, print_table, profile

    for block in [None] + a.block:
        sched = scheduler(a.model, None if block is None else a.draft[0], "cuda", block, max_running=max(a.batch),
                          context=a.context, dtype=a.dtype, threshold=a.threshold)
        try:
            decode_run(sched, [prompt], 8)  # warm-up
            runs = []
            t0 = time.perf_counter()
            prof = profile(lambda: runs.append(decode_run(sched, [prompt], a.new)), 1)
            wall = time.perf_counter() - t0
        finally:
            sched.close()
        _, toks, verify, _ = runs[0]
        steps = verify or toks
        gpu_us, rows = kernel_table(prof, steps, a.profile_top)
        mode = "off" if block is None else f"{Path(a.draft[0]).name} {block}"  # the first draft's only
        print_table(f"{mode}: {steps} steps, wall {wall / steps * 1e3:.2f} "
                    f"ms/step under the profiler", gpu_us, rows)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f}s")

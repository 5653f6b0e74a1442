"""Host time of the decode scheduler's DFlash loop outside the step itself (issue 33 item 3):
the real loop (glm53/support/decode_loop.py) on a trained target + draft, greedy, with the
model replaced by a replay of its recorded outputs, so what is timed is the scheduler's own
per-step work (building the blocks, acceptance, committing, stop checks, events) and nothing
of the model's.

    PYTHONPATH=. python benchmarks/spec_host.py --model DIR --draft DIR [--batch 16] [--block 8 16]
        [--new 128] [--repeat 20] [--stream-interval 1000]

One recorded run per block size (CPU, eager): every `WorkerGroup.spec_step` call's blocks and
`SpecOutput`. The replays then decode the same prompts again; each call returns the recorded
output after checking that the scheduler asked for the same blocks (last token, position, block
size), so a change to the loop that changes what it asks for fails here rather than timing
something else. Prints the host ms per step (median over repeats), steps, rows per step and τ.
`--stream-interval 1` (a server's default) also builds every request's token event every step
(the events are collected, not encoded or sent: the engine sends one frame per step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from glm53.support.corpus import held_file_prompts
from glm53.support.decode_loop import decode_run, scheduler


def record(sched, prompts: list[list[int]], new: int) -> tuple[list, list]:
    """One real run; every spec_step call's (blocks as tuples, output) in order."""
    calls, orig = [], sched.workers.spec_step

    def spy(blocks):
        out = orig(blocks)
        calls.append(([(b.last_token, b.start_pos, b.block_size) for b in blocks], out))
        return out

    sched.workers.spec_step = spy
    _, _, _, outs = decode_run(sched, prompts, new)
    sched.workers.spec_step = orig
    return calls, outs


def replay(sched, prompts: list[list[int]], new: int, calls: list, outs: list) -> tuple[float, int]:
    """Seconds of the loop with spec_step replayed from `calls`; checks it asked the same."""
    it = iter(calls)
    orig = sched.workers.spec_step

    def fake(blocks):
        want, out = next(it)
        got = [(b.last_token, b.start_pos, b.block_size) for b in blocks]
        if got != want:
            raise AssertionError("the loop asked for different blocks than the recorded run")
        return out

    sched.workers.spec_step = fake
    try:
        dt, _, _, got = decode_run(sched, prompts, new)
    finally:
        sched.workers.spec_step = orig
    if got != outs:
        raise AssertionError("replayed outputs differ from the recorded run")
    return dt, len(calls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--stream-interval", type=int, default=1000, help="token events every N tokens")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    prompts = held_file_prompts(a.model, a.batch, a.prompt)
    print(f"batch {a.batch}, {a.new} new tokens, prompts of {a.prompt} tokens, token events every "
          f"{a.stream_interval} tokens; host time of the loop, model replayed")
    print(f"{'block':>5} | {'steps':>5} | {'rows/step':>9} | {'tau':>5} | host ms/step | host us/row")
    for block in a.block:
        sched = scheduler(a.model, a.draft, "cpu", block, graphs=False, max_running=a.batch)
        sched.stream_interval = a.stream_interval
        try:
            calls, outs = record(sched, prompts, a.new)
            times = [replay(sched, prompts, a.new, calls, outs)[0] for _ in range(a.repeat)]
        finally:
            sched.close()
        rows = sum(len(c[0]) for c in calls)
        toks = a.batch * (a.new - 1)
        dt = statistics.median(times)
        print(f"{block:>5} | {len(calls):>5} | {rows / len(calls):9.1f} | {toks / rows:5.2f} | "
              f"{dt / len(calls) * 1e3:12.3f} | {dt / rows * 1e6:11.1f}", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f}s")

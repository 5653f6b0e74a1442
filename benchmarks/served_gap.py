"""Where the served path loses to the engine's own loop (issue 33, item 4): in one run, the decode
scheduler's loop on one in-process rank (`glm53.support.decode_loop`, no router, no prefill
instance) and the whole PD pipeline (router, prefill, NIXL transfer, decode) on the same prompts,
N requests at once, greedy, plain decoding (or `--draft`).

    PYTHONPATH=. python benchmarks/served_gap.py [--device cpu|cuda] [--concurrent 16] [--new 128]
        [--prompt 200] [--rounds 2] [--draft DIR --block 8] [--profile DIR] [--model DIR]

Served requests stream (`/generate`, `stream: true`), so each token's arrival is timed at the
client. The served figures split the window: `tok/s` = all output tokens / wall time (what
benchmarks/dflash_pd.py reports); TTFT p50 / max; `decode tok/s` = tokens after each request's
first / the span from the first request's first token to the last request's last token; ITL p50 /
p99 = gaps between a request's consecutive tokens. With stream_interval 1 every token is its
own event, so ITL is the decode step as the client sees it. `--profile DIR`: the prefill and decode
instances profile their serving loops (cProfile, GLM53_PROFILE_DIR) into DIR, printed at the end.

`--device cuda`: both instances on GPU 0 (one-GPU PD, bf16, CUDA graphs as served), as
benchmarks/dflash_pd.py.

`--model DIR` (default: the embedded trained target): e.g. a micro slice whose CPU step at batch
16 is ~1-2 ms, as a small model's is on a GPU, so that the served path's per-step host costs are
not hidden behind a long CPU step (`tools/make_slice.py` with small `--width`s and the embedded
tokenizer; the prompts are tokenized with the model's tokenizer).
"""

from __future__ import annotations

import argparse
import pstats
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import yaml

from glm53.kernels.compile_watch import AFTER_WARMUP
from glm53.support.cluster import Cluster
from glm53.support.corpus import held_file_prompts
from glm53.support.decode_loop import decode_run, scheduler
from glm53.support.pd_bench import on_one_gpu, router_sums, split_means, stream_events

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def stream(http: httpx.Client, url: str, ids: list[int], new: int) -> tuple[float, list[float], list[int]]:
    """(send time, each token's arrival time, the output ids) of one streamed request, on a client
    made before the clock starts (glm53/support/pd_bench.py says why)."""
    t0 = time.perf_counter()
    times: list[float] = []
    out: list[int] = []
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    for now, ev in stream_events(http, url, body):
        ids_now = ev.get("output_ids") or []
        times += [now] * (len(ids_now) - len(out))
        out = list(ids_now)
    return t0, times, out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def engine_loop(a, prompts: list[list[int]]) -> tuple[float, float, list]:
    """(decode-only rate, end-to-end rate, outputs) of the engine's loop on one in-process rank.
    End to end, the timed span also holds the prompts' prefill forwards (one prompt a forward), as
    the served window holds its prefill and transfer: the same work, without the serving parts."""
    sched = scheduler(a.model, a.draft, a.device, a.block, graphs=True,
                      dtype="bfloat16" if a.device == "cuda" else "float32", max_running=max(a.concurrent, 1),
                      context=1024)
    decode_run(sched, prompts[:2], 8)  # warm-up
    decode_run(sched, prompts[:2], 8, prefill=True)
    secs, toks, _, outs = decode_run(sched, prompts, a.new)
    e2e_secs, e2e_toks, _, _ = decode_run(sched, prompts, a.new, prefill=True)
    del sched
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return toks / secs, (e2e_toks + len(prompts)) / e2e_secs, outs


def print_profiles(d: Path, top: int = 25) -> None:
    """The instances' serving-loop profiles (GLM53_PROFILE_DIR), heaviest first by own time."""
    deadline = time.monotonic() + 30  # each instance writes its own at shutdown, maybe after `up` exits
    while len(list(d.glob("*.prof"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    for f in sorted(d.glob("*.prof")):
        print(f"--- {f.stem}: serving loop, top {top} by own time (cProfile) ---")
        st = pstats.Stats(str(f), stream=sys.stdout)
        st.sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--draft", type=Path, help="a DFlash/DSpark draft (default: plain decoding)")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="served rounds of --concurrent requests (the first one "
                    "pays what start-up left undone)")
    ap.add_argument("--profile", type=Path, help="profile the instances' serving loops into this directory")
    ap.add_argument("--stream-interval", type=int, default=1, help="decode's stream_interval (tokens per event)")
    ap.add_argument("--model", type=Path, default=ASSETS / "tiny-glm5", help="the target (default: the embedded one)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.device == "cpu":
        torch.set_num_threads(1)  # as the served ranks run (engine/processes.py): a fair loop
    prompts = held_file_prompts(a.model, a.concurrent, a.prompt)
    mode = "plain" if a.draft is None else f"{a.draft.name} block {a.block}"
    print(f"{a.concurrent} requests at once, {a.prompt}-token held-out prompts, {a.new} new tokens, greedy, {mode}, "
          f"{a.device}")

    loop_rate, e2e_rate, loop_outs = engine_loop(a, prompts)
    print(f"engine loop (decode only, one in-process rank): {loop_rate:.1f} tok/s; end to end (the prompts' "
          f"prefill forwards, one a prompt, then decode): {e2e_rate:.1f} tok/s", flush=True)

    cache = Path(tempfile.mkdtemp(prefix="served-gap-"))
    spec = None if a.draft is None else {"algorithm": "DFLASH", "draft_model_path": str(a.draft.resolve()),
                                         "num_draft_tokens": a.block}
    c = Cluster(Path(tempfile.mkdtemp()), cache, speculative=spec, stream_interval=a.stream_interval)
    c.cfg["model"]["path"] = str(a.model.resolve())
    c.cfg["defaults"].update(disable_radix_cache=True, chunked_prefill_size=8192)
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    if a.device == "cuda":
        on_one_gpu(c)
    if a.profile:
        c.env["GLM53_PROFILE_DIR"] = str(a.profile)
    c.start()
    try:
        clients = [httpx.Client() for _ in prompts]  # one per request thread (see `stream`)
        for p in prompts[:2]:
            stream(clients[0], c.url, p, 8)  # warm-up
        rounds = []
        for _ in range(a.rounds):
            before = router_sums(c.url)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.concurrent) as ex:
                res = list(ex.map(lambda hp: stream(hp[0], c.url, hp[1], a.new), zip(clients, prompts)))
            wall = time.perf_counter() - t0
            rounds.append((res, wall, split_means(router_sums(c.url), before), t0))
        c.log.flush()
        log = Path(c.log.name).read_text(errors="replace").splitlines()
    finally:
        c.stop()
    # What the instances logged that stalls a loop: kernels compiled after warm-up, long collections.
    for what in (AFTER_WARMUP, "GC pause", "warm-up:"):
        hits = [line for line in log if what in line]
        print(f"instances' log, '{what}': {len(hits)} line(s)")
        for line in hits[:6]:
            print("   ", line.strip()[-220:])

    for i, (res, wall, split, t0) in enumerate(rounds):
        toks = sum(len(out) for _, _, out in res)
        ttft = [ts[0] - sent for sent, ts, _ in res]
        first, last = min(ts[0] for _, ts, _ in res), max(ts[-1] for _, ts, _ in res)
        itl = [b - x for _, ts, _ in res for x, b in zip(ts, ts[1:])]
        after_first = toks - len(res)
        print(f"served round {i + 1} (router + prefill + NIXL + decode): {toks / wall:.1f} tok/s over {wall:.2f} s; "
              f"TTFT p50 {statistics.median(ttft) * 1e3:.1f} ms, max {max(ttft) * 1e3:.1f} ms; "
              f"decode {after_first / (last - first):.1f} tok/s from the first first token to the last token; "
              f"ITL p50 {statistics.median(itl) * 1e3:.2f} ms, p99 {pct(itl, 0.99) * 1e3:.2f} ms")
        print(f"  router's means: {split}")
        # The window's timeline, request by request in order of sending (ms from the round's start):
        # when it was sent, its first token, its last token. Shows whether the first tokens come
        # in one wave (one prefill step) or several, and how long decode runs after the last one.
        order = sorted(res, key=lambda r: r[0])
        ms = lambda xs: " ".join(f"{(x - t0) * 1e3:.0f}" for x in xs)  # noqa: E731
        print(f"  sent at   {ms(r[0] for r in order)}")
        print(f"  first at  {ms(r[1][0] for r in order)}")
        print(f"  last at   {ms(r[1][-1] for r in order)}")
        print(f"  ratios: engine loop / served tok/s {loop_rate / (toks / wall):.2f}x; engine loop / served decode "
              f"{loop_rate / (after_first / (last - first)):.2f}x; engine loop end to end / served tok/s "
              f"{e2e_rate / (toks / wall):.2f}x")
        same = [out for _, _, out in res] == [list(o) for o in loop_outs]
        print("  outputs: served == engine loop" if same else "  OUTPUTS DIFFER between the served path and the engine loop")
    if a.profile:
        print_profiles(a.profile)


if __name__ == "__main__":
    main()

"""What makes the colocated pair's ITL p99 (issue 33 item 1): the slice served by a colocated
prefill+decode pair on one GPU, every process of the server watched for stalls
(glm53/support/stall_watch.py: GIL held, a thread waiting in one frame, garbage collections), and
the client's longest intervals matched against them by time.

Variants, each a fresh server: `freeze` (the tree as it is: each serving process freezes its heap
once built, server/heap.py) and `nofreeze` (gc.freeze made a no-op in every process: the server as
it was). For each: one request alone, then `--rounds` points of `--concurrency` requests at once
(fresh random prompts each, so nothing is prefix-cached); ITL p50/p90/p99, TTFT p50, the GC pauses
the server logged, and for the intervals over 4x p50: their token index (0 = first to second
token), and what overlapped them (a GIL stall, a collection, in which process).

    PYTHONPATH=. python3 benchmarks/colocate_stalls.py --out DIR [--variants freeze nofreeze]

The router's wheels (fastapi, starlette, pydantic, uvicorn, pyzmq, msgpack, nixl) must be
installed on the device. A JSON report goes to DIR/colocate_stalls.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

from glm53.support import stall_watch
from glm53.support.glm5_slice import ensure_slice
from glm53.support.gpu_server import Server, cluster_config
from glm53.support.serving_sweep import sweep_point


def roles(recs: list[dict]) -> dict[int, str]:
    """pid -> "pair" (a process with threads d0 and p0), "router" (uvicorn frames) or "other"."""
    out: dict[int, str] = {}
    for r in recs:
        names = set(r.get("stacks", {})) | ({r["thread"]} if "thread" in r else set())
        frames = " ".join(" ".join(s) for s in r.get("stacks", {}).values()) + " ".join(r.get("stack", []))
        if {"d0", "p0"} & names:
            out[r["pid"]] = "pair"
        elif "uvicorn" in frames or "starlette" in frames or "routing.py" in frames:
            out.setdefault(r["pid"], "router")
    return out


def explain(point: dict, recs: list[dict], role: dict[int, str]) -> dict:
    """The point's intervals over 4x p50, with what overlapped each by more than half its length."""
    p50 = point["itl_p50"]
    big = [w for w in point["itl_worst"] if w[0] > 4 * p50]
    rows, why = [], Counter()
    for dt, req, k, a in big:
        b = a + dt
        hits = []
        for r in recs:
            if r["kind"] == "stuck" and r.get("thread") not in ("d0", "p0"):
                continue
            ov = min(b, r["t1"]) - max(a, r["t0"])
            if ov > 0.5 * dt:
                who = role.get(r["pid"], "other")
                label = f"{r['kind']}@{who}"
                if r["kind"] == "stuck":
                    label += f":{r['thread']}:{r['stack'][0]}"
                elif r["kind"] == "gil":
                    label += ":" + " | ".join(f"{t}:{s[0]}" for t, s in r["stacks"].items() if s and t in ("d0", "p0", "MainThread"))
                hits.append(label)
        for h in set(hits):
            why[h] += 1
        rows.append({"ms": dt * 1e3, "req": req, "token": k, "overlaps": sorted(set(hits))})
    first = sum(1 for r in rows if r["token"] == 0)
    return {"over_4x_p50": len(big), "of_them_first_interval": first, "kept": len(point["itl_worst"]),
            "causes": why.most_common(20), "worst": rows[:15]}


def run_variant(name: str, a, out: Path, vocab: int) -> dict:
    vdir = out / name
    watch, site = vdir / "watch", vdir / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(stall_watch.sitecustomize_source(str(watch), no_freeze=name == "nofreeze"))
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{site}:{old}" if old else str(site)
    cpu = a.device == "cpu"
    cfg = cluster_config(a.slice, "float32" if cpu else "bfloat16", not cpu, [0] * 5, a.input_len + a.output_len + 64,
                         device=a.device)
    cfg["prefill"][0].update(chunked_prefill_size=a.chunk, colocate="d0", colocate_sms=a.colocate)
    rep: dict = {"variant": name}
    try:
        with Server(cfg, vdir, name) as s:
            asyncio.run(sweep_point(s.url, "m", 1, 2, a.input_len, a.output_len, vocab, 99))
            pts, spans = [], []
            for i in range(a.rounds):
                t0 = time.perf_counter()
                pts.append(asyncio.run(sweep_point(s.url, "m", a.concurrency, a.concurrency, a.input_len,
                                                   a.output_len, vocab, 1000 + i)))
                spans.append((t0, time.perf_counter()))
            s.log.flush()
            log = (vdir / f"{name}.log").read_text(errors="replace")
    finally:
        os.environ["PYTHONPATH"] = old
    every = stall_watch.read(str(watch))
    role = roles(every)
    # Only what happened while the points ran (start-up's collections and loads are not serving).
    recs = [r for r in every if any(r["t1"] > t0 and r["t0"] < t1 for t0, t1 in spans)]
    rep["gc_pause_lines"] = [line.strip()[-160:] for line in log.splitlines() if "GC pause" in line]
    rep["heap_lines"] = [line.strip()[-160:] for line in log.splitlines() if "heap frozen" in line]
    rep["points"] = []
    for i, p in enumerate(pts):
        ex = explain(p, recs, role)
        rep["points"].append({k: v for k, v in p.items() if k != "itl_worst"} | {"explained": ex})
        print(f"{name} round {i}: TTFT p50 {p['ttft_p50']:.2f} s, ITL p50 {p['itl_p50'] * 1e3:.2f} ms, "
              f"p90 {p['itl_p90'] * 1e3:.2f} ms, p99 {p['itl_p99'] * 1e3:.2f} ms "
              f"({p['itl_p99'] / p['itl_p50']:.1f}x p50), {p['out_tok_s']:.0f} tok/s; "
              f"{ex['over_4x_p50']} intervals over 4x p50 (first interval: {ex['of_them_first_interval']})", flush=True)
        for c, n in ex["causes"][:8]:
            print(f"    {n:4d} overlap {c}", flush=True)
        for w in ex["worst"][:6]:
            print(f"    {w['ms']:7.1f} ms req {w['req']} token {w['token']}: {w['overlaps']}", flush=True)
    gcs = [r for r in recs if r["kind"] == "gc"]
    rep["gc_over_10ms"] = {who: [round((r["t1"] - r["t0"]) * 1e3, 1) for r in gcs if role.get(r["pid"], "other") == who]
                           for who in set(role.values()) | {"other"}}
    gils = [r for r in recs if r["kind"] == "gil"]
    rep["gil_stalls_ms"] = {who: sorted((round((r["t1"] - r["t0"]) * 1e3, 1) for r in gils
                                         if role.get(r["pid"], "other") == who), reverse=True)[:20]
                            for who in set(role.values()) | {"other"}}
    print(f"{name}: GC pauses logged by the server: {len(rep['gc_pause_lines'])}; watched collections >= 10 ms by "
          f"process: { {k: (len(v), max(v, default=0)) for k, v in rep['gc_over_10ms'].items()} }; "
          f"GIL stalls (longest) by process: { {k: v[:5] for k, v in rep['gil_stalls_ms'].items()} }", flush=True)
    for line in rep["heap_lines"][:4]:
        print("   ", line, flush=True)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--slice", default="/tmp/glm5-slice", help="made if missing (on cuda)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: to check the script here, "
                    "with --slice an existing model directory (e.g. the embedded target's)")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--colocate", type=int, default=48, metavar="SMS")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["nofreeze", "freeze"], choices=["freeze", "nofreeze"])
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.device == "cuda":
        ensure_slice(Path(a.slice))
    vocab = json.loads((Path(a.slice) / "config.json").read_text())["vocab_size"]
    report = {"args": vars(a), "variants": [run_variant(v, a, out, vocab) for v in a.variants]}
    for v in report["variants"]:
        p99 = [p["itl_p99"] / p["itl_p50"] for p in v["points"]]
        print(f"SUMMARY {v['variant']}: ITL p99/p50 per round {[round(x, 1) for x in p99]}; "
              f"TTFT p50 {[round(p['ttft_p50'], 2) for p in v['points']]} s", flush=True)
    (out / "colocate_stalls.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()

"""No Triton compiles after start-up (issue 33 item 1), served on one GPU (made for the device tool).

The GLM-5-width slice (tools/make_slice.py via glm53.support.glm5_slice) served by a colocated
prefill+decode pair (`prefill.colocate: d0`) with a fresh TRITON_CACHE_DIR, so every variant the
server needs is compiled in this run. The ranks' start-up warm-up (models/warmup.py) logs how many
variants it reached and how long it took; afterwards every Triton JIT cache miss is logged as
"Triton compile after warm-up" (kernels/compile_watch.py). The benchmark then serves one request
alone and a concurrency point (default 64 requests at once), and reports ITL p50/p99, TTFT p50
and the compiles logged after the server was ready (target: zero; ITL p99 <= 4x p50).

    PYTHONPATH=. python3 benchmarks/no_compiles.py --out DIR [--chunk 4096] [--colocate 48]

The router needs fastapi, starlette, pydantic (+ pydantic_core, annotated-types,
typing-inspection), uvicorn, pyzmq, msgpack and nixl, which the device image lacks: carry them
as wheels. A JSON report goes to DIR/no_compiles.json; the server's log beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
from pathlib import Path

from glm53.kernels.compile_watch import AFTER_WARMUP
from glm53.support.glm5_slice import ensure_slice
from glm53.support.gpu_server import Server, cluster_config
from glm53.support.serving_sweep import sweep_point


def compiles_after(log: Path) -> list[str]:
    return [line.strip() for line in log.read_text(errors="replace").splitlines() if AFTER_WARMUP in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--slice", default="/tmp/glm5-slice")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill's chunked_prefill_size")
    ap.add_argument("--colocate", type=int, default=48, metavar="SMS", help="0: two processes on GPU 0")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=64)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")  # fresh: nothing compiled yet
    ensure_slice(Path(a.slice))
    vocab = json.loads((Path(a.slice) / "config.json").read_text())["vocab_size"]
    cfg = cluster_config(a.slice, "bfloat16", True, [0] * 5, a.input_len + a.output_len + 64)
    cfg["prefill"][0].update(chunked_prefill_size=a.chunk)
    if a.colocate:
        cfg["prefill"][0].update(colocate="d0", colocate_sms=a.colocate)
    tag = f"no-compiles-chunk{a.chunk}" + (f"-colocated{a.colocate}" if a.colocate else "")
    report: dict = {"args": vars(a)}
    with Server(cfg, out, tag) as s:
        log = out / f"{tag}.log"
        s.log.flush()
        warm = [line.strip() for line in log.read_text(errors="replace").splitlines() if "warm-up:" in line]
        report["startup_s"] = s.startup_s
        report["warmup_lines"] = warm
        print("\n".join(warm), flush=True)
        one = asyncio.run(sweep_point(s.url, "m", 1, 2, a.input_len, a.output_len, vocab, 99))
        s.log.flush()
        report["compiles_after_one_request"] = len(compiles_after(log))
        r = asyncio.run(sweep_point(s.url, "m", a.concurrency, max(a.requests, a.concurrency), a.input_len,
                                    a.output_len, vocab, a.concurrency))
        s.log.flush()
        after = compiles_after(log)
    report.update(one=one, point=r, compiles_after_ready=len(after), compiled=after[:50])
    secs = [float(m.group(1)) for w in warm for m in [re.search(r"in ([0-9.]+) s", w)] if m]
    print(f"{tag}: warm-up {sum(secs):.1f} s over {len(warm)} ranks; concurrency {a.concurrency}: "
          f"{r['ok']}/{r['n']} ok, TTFT p50 {r['ttft_p50']:.2f} s, ITL p50 {r['itl_p50'] * 1e3:.2f} ms, "
          f"p99 {r['itl_p99'] * 1e3:.2f} ms ({r['itl_p99'] / r['itl_p50']:.1f}x p50), {r['out_tok_s']:.0f} tok/s; "
          f"Triton compiles after ready: {len(after)} (after the first request: "
          f"{report['compiles_after_one_request']})", flush=True)
    for line in after[:20]:
        print("  " + line[:300], flush=True)
    (out / "no_compiles.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()

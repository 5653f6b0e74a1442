"""How many streamed tokens a second the router delivers, with no model in the way.

`glm53-serve up` with test-double instances (tests/server/fake_instance.py: a decode "step" every
`--step-ms`, one token for every running request, sent as one frame per step like the real
engine), and `benchmarks/serving.py`'s client (glm53.support.serving_sweep) at each concurrency.
The offered rate is concurrency / step: where the delivered rate falls short of it, the router
(or, on a small machine, the client beside it) is what limits a fast decode, and the client's
inter-token intervals show bursts instead of the step time.

    PYTHONPATH=. python benchmarks/router_stream.py [--concurrency 1 16 64] [--output-len 256] [--step-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=2.0)
    a = ap.parse_args()
    os.environ["GLM53_INSTANCE_IMPL"] = str(ROOT / "tests" / "server" / "fake_instance.py")
    os.environ["FAKE_TOKEN_DELAY"] = str(a.step_ms / 1e3)
    from glm53.support.cluster import Cluster
    from glm53.support.serving_sweep import sweep_point

    with tempfile.TemporaryDirectory() as wd:
        cluster = Cluster(Path(wd), Path(os.environ.get("GLM53_CACHE", Path(wd) / "cache"))).start()
        try:
            print(f"{'conc':>5} {'offered tok/s':>14} {'delivered tok/s':>16} {'ratio':>6} {'ITL p50':>8} {'ITL p99':>8}")
            for conc in a.concurrency:
                r = asyncio.run(sweep_point(cluster.url, "glm-5-tiny", conc, conc, 64, a.output_len, 4000, 0))
                offered = conc / (a.step_ms / 1e3)
                print(f"{conc:5d} {offered:14.0f} {r['out_tok_s']:16.0f} {r['out_tok_s'] / offered:6.2f} "
                      f"{r['itl_p50'] * 1e3:6.2f}ms {r['itl_p99'] * 1e3:6.2f}ms", flush=True)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()

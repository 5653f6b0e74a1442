"""Pipeline-parallel prefill on the CPU: time to first token against prompt length for pp = 1, 2,
4, whether the stages overlap, and the bytes each stage boundary carries per token, in one run.

    PYTHONPATH=. python benchmarks/pp_cpu.py [--lengths 512 1024 2048] [--pp 1 2 4] [--chunk 128]

The prefill ranks are the server's own (`ProcessWorkers`, gloo rank processes, one thread each),
driven the way the prefill scheduler drives them: per step one micro-batch per stage, each one
chunk of the prompt; TTFT here is the wall time of the prompt's steps (no router, no transfer).
"Overlap" compares that wall time with the sum of the stages' busy times (compute only, waiting
for the previous stage excluded): below 1.0 means stages ran at the same time.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from glm53.models import write_random_draft
from glm53.server.embedded_model import ensure_embedded_model
from glm53.support.pp_ttft import ttft_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dflash", action="store_true", help="with a random DFlash draft (partial projection)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="pp-bench-"))
    model_dir = ensure_embedded_model(tmp / "cache")
    draft = write_random_draft(tmp / "draft", model_dir, n_layers=2, block_size=4) if a.dflash else None
    ttft_table(model_dir, draft, a.lengths, a.pp, a.chunk, a.repeat)


if __name__ == "__main__":
    main()

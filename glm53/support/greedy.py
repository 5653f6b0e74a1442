"""Greedy outputs to compare on the GPU: the CPU reference (`glm53-serve generate` on the CPU,
`cpu_reference`) and a served model's for prompts sent at once (`served_greedy`), over prompts of
`PROMPT_LENS` tokens. Used by benchmarks/gpu_e2e.py (`exact`) and benchmarks/gpu_checks.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPT_LENS = (7, 100, 300, 41, 180, 65)


def cpu_reference(model: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy outputs of `glm53-serve generate` on the CPU (the reference path)."""
    cmd = [sys.executable, "-m", "glm53.server.cli", "generate", "--model", str(model), "--max-new-tokens", str(new),
           "--page-size", "16", "--ignore-eos"]
    for p in prompts:
        cmd += ["--input-ids", ",".join(map(str, p))]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return [json.loads(line)["output_ids"] for line in res.stdout.splitlines()]


async def served_greedy(url: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy outputs of a served model for `prompts`, sent at once."""
    import httpx

    async with httpx.AsyncClient(timeout=300) as http:
        async def one(p):
            r = await http.post(f"{url}/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": new, "temperature": 0, "ignore_eos": True}})
            r.raise_for_status()
            return r.json()["output_ids"]
        return await asyncio.gather(*(one(p) for p in prompts))

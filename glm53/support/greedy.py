"""Greedy outputs to compare on the GPU: the CPU reference (`glm53-serve generate` on the CPU,
`cpu_reference`) and a served model's for prompts sent at once (`served_greedy`), over prompts of
`PROMPT_LENS` tokens. Used by benchmarks/gpu_e2e.py (`exact`) and benchmarks/gpu_checks.py; and
greedy decoding through a runner's draft (`spec_greedy`: tools/train_mtp.py, the GPU MTP test).
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


def spec_greedy(runner, prompts: list[list[int]], pages: list[list[int]], new: int,
                width: int) -> tuple[list[list[int]], int, int]:
    """Greedy decoding through `runner.spec_step` (a models.ModelRunner with a draft), committing
    as the decode loop does: the drafts equal to the target's argmax, then its token. Blocks are
    keyed by prompt index (the MTP draft keeps state per key). Returns (the outputs, tokens
    committed by the verify steps after each request's first, those verify steps): a request's
    first step has no draft context yet for the MTP layer, so τ leaves it out."""
    from glm53.models import DraftBlock, SeqChunk

    outs = [[int(lg[-1].argmax())] for lg in runner.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)])]
    committed = verifies = 0
    first = True
    while any(len(o) < new for o in outs):
        idx = [i for i, o in enumerate(outs) if len(o) < new]
        blocks = [DraftBlock(outs[i][-1], len(prompts[i]) + len(outs[i]) - 1, pages[i],
                             block_size=min(width, new - len(outs[i])), key=i) for i in idx]
        res = runner.spec_step(blocks)
        for j, i in enumerate(idx):
            d, am = res.drafts[j], res.greedy[j]
            a = 0
            while a < len(d) and d[a] == am[a]:
                a += 1
            toks = (d[:a] + [am[a]])[: new - len(outs[i])]
            outs[i].extend(toks)
            if not first:
                committed, verifies = committed + len(toks), verifies + 1
        first = False
    return outs, committed, verifies

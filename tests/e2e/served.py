"""Helpers of the e2e tests against a served cluster (glm53.support.cluster): the served model's
name, greedy outputs of the PD pipeline (`served_greedy`) and of the model core's one-process
`glm53-serve generate` (`offline_greedy`) over `GREEDY_PROMPTS`, and waiting until every KV page
is free again (`wait_pages_free`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from glm53.support.cluster import ROOT

MODEL = "glm-5-tiny"


def wait_pages_free(cluster, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    used = {}
    while time.monotonic() < deadline:
        used = cluster.kv_tokens_in_use()
        if used and all(v == 0 for v in used.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"KV pages still in use: {used}")


def served_greedy(cluster, prompts: list[list[int]], new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        r = httpx.post(f"{cluster.url}/generate", timeout=120, json={
            "input_ids": p, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        outs.append(r.json()["output_ids"])
    return outs


# The most new tokens an e2e test asks of the offline reference: one `generate` run per model and
# prompt set then serves every test (a session's e2e modules asked the same prompts of the same
# checkpoint seven times, ~6 s a run on two cores)
OFFLINE_TOKENS = 24
_offline: dict[tuple[str, tuple[tuple[int, ...], ...]], list[list[int]]] = {}


def offline_greedy(model_dir, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The model core's one-process `glm53-serve generate`: each prompt's first `new` greedy tokens
    (EOS ignored). Greedy decoding makes a shorter continuation the prefix of a longer one, so the
    run is made once per (checkpoint path, prompts), for at least OFFLINE_TOKENS, and sliced."""
    key = (str(Path(model_dir).resolve()), tuple(map(tuple, prompts)))
    outs = _offline.get(key)
    if outs is None or min(map(len, outs), default=new) < new:
        cmd = [sys.executable, "-m", "glm53.server.cli", "generate", "--model", str(model_dir),
               "--max-new-tokens", str(max(new, OFFLINE_TOKENS)), "--page-size", "16", "--ignore-eos"]
        for p in prompts:
            cmd += ["--input-ids", ",".join(map(str, p))]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        outs = _offline[key] = [json.loads(line)["output_ids"] for line in res.stdout.splitlines()]
    return [o[:new] for o in outs]


# Prompts longer than the embedded model's index_topk (64) exercise sparse attention on both
# sides of the transfer.
GREEDY_PROMPTS = [[(i * 37 + 11) % 4000 + 10 for i in range(n)] for n in (7, 100, 300)]

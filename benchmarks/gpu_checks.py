"""GPU correctness checks of the served embedded model (made for the device tool; CI has no GPU).

    PYTHONPATH=. python3 benchmarks/gpu_checks.py api --out DIR   # one GPU: one-GPU PD, plain (CUDA graphs) and DFlash
    PYTHONPATH=. python3 benchmarks/gpu_checks.py x2 --out DIR    # two GPUs: PD across GPUs, decode tp=2, prefill tp=2,
                                                                  # and both with ep=2 (experts split, all-to-all over NCCL)

Every topology serves the trained embedded model in fp32 and must give the CPU reference's greedy
output (`glm53-serve generate` on the CPU) for a concurrent batch of prompts. `api` also checks the
API features on the GPU path: chat logprobs, seeded n = 3 (deterministic), penalties with
logit_bias and min_tokens, a JSON-schema answer, and a /generate batch with a regex and logprobs.
A JSON report goes to DIR/gpu_checks.json; servers' logs beside it (glm53.support.gpu_server's
`Server`, as benchmarks/gpu_e2e.py's, so the router's wheels must travel with the run, as there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import httpx

from glm53.support.gpu_server import Server, cluster_config
from glm53.support.greedy import PROMPT_LENS, cpu_reference, served_greedy

NEW = 24
PROMPTS = [[(i * 37 + 11 * n) % 4000 + 10 for i in range(n)] for n in PROMPT_LENS]
REGEX = r"[a-c]{3}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def api_checks(url: str) -> dict[str, bool]:
    ok: dict[str, bool] = {}
    c = httpx.Client(timeout=300)
    msgs = [{"role": "user", "content": "Write a Python function."}]
    r = c.post(url + "/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 12,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": 3}).json()
    lp = r["choices"][0]["logprobs"]["content"]
    ok["chat_logprobs"] = len(lp) >= 1 and all(x["logprob"] <= 0 and len(x["top_logprobs"]) == 3 for x in lp)
    body = {"model": "m", "prompt": "import os\n", "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 3}
    a, b = (c.post(url + "/v1/completions", json=body).json() for _ in range(2))
    ok["n3_seeded_deterministic"] = ("choices" in a and len(a["choices"]) == 3
                                     and [x["text"] for x in a["choices"]] == [x["text"] for x in b["choices"]])
    r = c.post(url + "/v1/completions", json={"model": "m", "prompt": "import os\n", "max_tokens": 16,
                                              "temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5,
                                              "logit_bias": {"10": -100}, "min_tokens": 4})
    ok["penalties"] = r.status_code == 200
    r = c.post(url + "/v1/chat/completions", json={
        "model": "m", "messages": msgs, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    try:
        ok["json_schema"] = set(json.loads(r["choices"][0]["message"]["content"])) == {"n", "ok"}
    except (KeyError, ValueError):
        ok["json_schema"] = False
    r = c.post(url + "/generate", json={"text": ["def f():", "x = "], "return_logprob": True, "top_logprobs_num": 2,
                                        "sampling_params": {"max_new_tokens": 16, "regex": REGEX}}).json()
    ok["generate_regex_batch_logprobs"] = isinstance(r, list) and all(
        re.fullmatch(REGEX, x["text"]) and len(x["meta_info"]["output_token_logprobs"]) == len(x["output_ids"])
        for x in r)
    return ok


def topologies(which: str, draft: Path) -> list[tuple[str, dict, dict, dict | None]]:
    """(tag, prefill overrides, decode overrides, speculative section)."""
    if which == "api":
        spec = {"algorithm": "DFLASH", "draft_model_path": str(draft), "num_draft_tokens": 4}
        return [("one-gpu-plain-graphs", {}, {}, None), ("one-gpu-dflash", {}, {}, spec)]
    return [("prefill-gpu0-decode-gpu1", {"devices": [0]}, {"devices": [1]}, None),
            ("decode-tp2-gpu01", {"devices": [0]}, {"devices": [0, 1], "tp": 2}, None),
            ("prefill-tp2-gpu01-decode-gpu1", {"devices": [0, 1], "tp": 2}, {"devices": [1]}, None),
            ("decode-tp2-ep2-gpu01", {"devices": [0]}, {"devices": [0, 1], "tp": 2, "ep": 2}, None),
            ("prefill-tp2-ep2-gpu01-decode-gpu1", {"devices": [0, 1], "tp": 2, "ep": 2}, {"devices": [1]}, None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["api", "x2"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from glm53.server.embedded_model import ensure_embedded_draft, ensure_embedded_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_embedded_model()
    cpu = cpu_reference(model, PROMPTS, NEW)
    report = {}
    for tag, pre, dec, spec in topologies(args.which, ensure_embedded_draft()):
        cfg = cluster_config(str(model), "float32", True, [0] * 5, 1024)
        cfg["prefill"][0].update(pre)
        cfg["decode"][0].update(dec)
        if spec:
            cfg["speculative"] = spec
        t0 = time.monotonic()
        try:
            with Server(cfg, out, tag) as s:
                gpu = asyncio.run(served_greedy(s.url, PROMPTS, NEW))
                row = {"greedy_equal_cpu": f"{sum(a == b for a, b in zip(cpu, gpu))}/{len(PROMPTS)}"}
                if args.which == "api":
                    row.update(api_checks(s.url))
        except Exception as e:  # one topology's failure is a result, not the end of the run
            row = {"error": repr(e)[:400]}
        report[tag] = row
        print(tag, row, f"({time.monotonic() - t0:.0f} s)", flush=True)
    (out / "gpu_checks.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

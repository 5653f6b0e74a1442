"""PD end to end with an FP8 KV cache (`kv_cache_dtype: fp8_e4m3` on both instances): prefill writes
the FP8 latent rows and indexer keys, the UCX transfer moves their bytes as they are, decode reads
them. Greedy output must equal the model core's with the same FP8 cache in one process; one
prompt is chosen where FP8 and fp32 caches give different greedy outputs, so a deployment that
silently kept fp32 pages, or a transfer that garbled the bytes, would not pass."""

from __future__ import annotations

import json

import httpx
import yaml

from glm53.models import ModelRunner, PageAllocator
from glm53.server import offline
from glm53.server.embedded_model import EMBEDDED_DIRNAME
from glm53.support.cluster import Cluster

# Longer than the embedded model's index_topk (64); with 300 tokens the FP8 and fp32 greedy
# outputs differ from the first token (measured), with 100 they agree.
PROMPTS = [[(i * 37 + 11) % 4000 + 10 for i in range(n)] for n in (100, 300)]
NEW = 12


def test_fp8_kv_through_the_pd_pipeline(tmp_path, model_cache, capsys):
    c = Cluster(tmp_path, model_cache, transfer_timeout_s=20.0)
    c.cfg["defaults"]["kv_cache_dtype"] = "fp8_e4m3"
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    c.start()
    try:
        served = []
        for p in PROMPTS:
            r = httpx.post(f"{c.url}/generate", timeout=120, json={
                "input_ids": p, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            served.append(r.json()["output_ids"])
    finally:
        c.stop()
    # the model core in this process, through `glm53-serve generate --kv-cache-dtype fp8_e4m3`
    model = model_cache / EMBEDDED_DIRNAME
    argv = ["--model", str(model), "--max-new-tokens", str(NEW), "--page-size", "16", "--ignore-eos",
            "--kv-cache-dtype", "fp8_e4m3"]
    capsys.readouterr()
    assert offline.main(argv + [a for p in PROMPTS for a in ("--input-ids", ",".join(map(str, p)))]) == 0
    want = [json.loads(line)["output_ids"] for line in capsys.readouterr().out.splitlines()]
    assert served == want
    ref = ModelRunner.from_dir(model, page_size=16, num_pages=64, progress=False)
    fp32 = offline.greedy_generate(ref, PageAllocator(64), PROMPTS[1:], NEW, True)
    assert fp32[0] != want[1], "this prompt must tell an FP8 cache from an fp32 one"

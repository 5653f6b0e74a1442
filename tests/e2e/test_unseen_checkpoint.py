"""A checkpoint the project never saw, served as a user brings it: a random GLM-5 written by
transformers' `save_pretrained` (no tokenizer, 3 layers, vocabulary 300) with a random 2-layer
DFlash draft (`tools/make_draft.py`'s writer; its default target layers on a target this shallow).

Without tokenizer.json, `up` refuses the config naming model.path; with
`model.skip_tokenizer_init` it serves token ids (SGLang's and vLLM's --skip-tokenizer-init):
greedy output through PD + DFlash equals transformers' own greedy decoding, OpenAI completions
return the ids (`return_token_ids`) and name logprob tokens `token_id:N`, and everything that
needs text is a 400 naming why."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
import yaml

from glm53.models.draft_checkpoint import write_random_draft
from glm53.support.cluster import ROOT, Cluster
from glm53.support.oracle import make_checkpoint

PROMPTS = [[(i * 53 + 7) % 290 + 3 for i in range(n)] for n in (5, 40, 90)]  # index_topk 16: sparse
NEW = 12


@pytest.fixture(scope="module")
def unseen(tmp_path_factory):
    root = tmp_path_factory.mktemp("unseen")
    ref = make_checkpoint(root / "target", seed=5, vocab_size=300, hidden_size=96, num_hidden_layers=3,
                          index_topk=16, eos_token_id=[299], index_topk_freq=2, index_skip_topk_offset=1)
    write_random_draft(root / "draft", root / "target", seed=3, n_layers=2, block_size=8, num_heads=2, num_kv_heads=1)
    return root, ref


def reference_greedy(ref, prompt: list[int]) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW):
            out.append(int(ref(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def configure(c: Cluster, root, skip: bool) -> Cluster:
    c.cfg["model"] = {"path": str(root / "target"), "served_model_name": ["unseen"], "context_length": 512,
                      **({"skip_tokenizer_init": True} if skip else {})}
    c.cfg["speculative"] = {"algorithm": "DFLASH", "draft_model_path": str(root / "draft"), "num_draft_tokens": 4}
    c.cfg["defaults"].update(page_size=4, num_pages=512)
    c.config_path.write_text(yaml.safe_dump(c.cfg))
    return c


def test_a_checkpoint_without_tokenizer_is_a_config_error(unseen, tmp_path, model_cache):
    root, _ = unseen
    c = configure(Cluster(tmp_path, model_cache), root, skip=False)
    res = subprocess.run([sys.executable, "-m", "glm53.server.cli", "config", "--config", str(c.config_path)],
                         capture_output=True, text=True, cwd=ROOT, env=c.env, timeout=120)
    assert res.returncode != 0
    assert "model.path" in res.stderr and "skip_tokenizer_init" in res.stderr, res.stderr[-2000:]


def test_served_token_ids_equal_transformers_greedy(unseen, tmp_path, model_cache):
    root, ref = unseen
    c = configure(Cluster(tmp_path, model_cache), root, skip=True).start()
    try:
        for p in PROMPTS:
            r = httpx.post(f"{c.url}/generate", timeout=120, json={
                "input_ids": p, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["text"] == "" and body["output_ids"] == reference_greedy(ref, p)
            assert body["meta_info"]["spec_verify_ct"] >= 1  # DFlash verified them

        r = httpx.post(f"{c.url}/v1/completions", timeout=60, json={
            "model": "unseen", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        want = reference_greedy(ref, PROMPTS[1])[:4]
        assert choice["text"] == "" and choice["token_ids"] == want and choice["prompt_token_ids"] == PROMPTS[1]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]
        assert all(len(t) == 2 for t in choice["logprobs"]["top_logprobs"])

        refused = [
            ("/v1/completions", {"model": "unseen", "prompt": "def f():", "max_tokens": 2}, None),
            ("/v1/chat/completions", {"model": "unseen", "messages": [{"role": "user", "content": "hi"}]}, None),
            ("/v1/completions", {"model": "unseen", "prompt": [1, 2, 3], "max_tokens": 2, "stop": ["x"]}, "stop"),
            ("/v1/completions", {"model": "unseen", "prompt": [1, 2, 3], "max_tokens": 2,
                                 "response_format": {"type": "json_object"}}, "response_format"),
            ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}}, None),
            ("/tokenize", {"prompt": "hello"}, None),
            ("/detokenize", {"tokens": [1, 2]}, None),
        ]
        for path, body, param in refused:
            r = httpx.post(c.url + path, json=body, timeout=30)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert "skip_tokenizer_init" in err["message"] and err["param"] == param, (path, err)
        assert httpx.get(c.url + "/health_generate", timeout=60).status_code == 200
    finally:
        c.stop()

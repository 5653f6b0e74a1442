import hashlib
import json
import threading

import pytest
from safetensors import safe_open

from glm53.server.embedded_model import (
    SPECIAL_TOKENS, ensure_embedded_model, model_config, weight_shapes, write_weights,
)


def test_layout_matches_hf_names(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert "full" in cfg["indexer_types"] and "shared" in cfg["indexer_types"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(weight_shapes(cfg))
    for i, kind in enumerate(cfg["indexer_types"]):
        has = any(k.startswith(f"model.layers.{i}.self_attn.indexer.") for k in keys)
        assert has == (kind == "full"), f"layer {i}: indexer weights must exist only on full layers"
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.1.mlp.experts.0.up_proj.weight" in keys
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    assert (model_dir / "chat_template.jinja").is_file()


def test_our_loader_takes_every_tensor_with_its_stored_shape_and_dtype(model_dir):
    import torch

    from glm53.models import GlmConfig, GlmForCausalLM, load_weights

    cfg = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        stored = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    names = {torch.bfloat16: "BF16", torch.float32: "F32"}
    assert stored == {n: (s, names[d]) for n, (s, d) in weight_shapes(cfg).items()}
    load_weights(GlmForCausalLM(GlmConfig.from_dir(model_dir)), model_dir, progress=False)  # none missing/unexpected


def test_weights_are_pinned(tmp_path):
    """The derived tensor list draws the same values in the same order as EMBEDDED_VERSION 1 did
    (hash of every tensor's name, dtype, shape and bytes, for a fixed vocabulary)."""
    import torch
    from safetensors.torch import load_file

    ids = {t: 4096 + k for k, (t, _) in enumerate(SPECIAL_TOKENS)}
    write_weights(model_config(4160, ids), tmp_path / "model.safetensors")
    sd = load_file(str(tmp_path / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    assert len(sd) == 225
    assert h.hexdigest() == "9f3c57dc2a3625a82dd74c1a16ace9729c9667b47d265267ce92c1060d212351"


def test_transformers_loads_it_without_missing_or_unexpected_keys(model_dir):
    transformers = pytest.importorskip("transformers")
    import torch

    model, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert info["missing_keys"] == [] or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.indexer_types == json.loads((model_dir / "config.json").read_text())["indexer_types"]
    with torch.no_grad():
        logits = model(torch.arange(300, 380).unsqueeze(0)).logits  # 80 > index_topk: sparse path
    assert torch.isfinite(logits).all() and logits[0, -1].float().std() > 1.0


def test_concurrent_creation_is_atomic(tmp_path):
    out, errors = [], []

    def run():
        try:
            out.append(ensure_embedded_model(tmp_path))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(out)) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [out[0].name]

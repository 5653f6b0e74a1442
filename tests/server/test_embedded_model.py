import json
import threading

import pytest
from safetensors import safe_open

from glm53.server.embedded_model import ensure_embedded_model, weight_shapes


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

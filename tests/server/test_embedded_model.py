import hashlib
import json
import threading

import pytest
from safetensors import safe_open

from glm53.server.embedded_model import (
    ASSETS, EMBEDDED_DRAFT, MODEL_DIMS, SPECIAL_TOKENS, ensure_embedded_draft, ensure_embedded_dspark,
    ensure_embedded_model, ensure_random_model, model_config, resolve_draft_path, weight_shapes, write_weights,
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
    # The MTP layer (index num_hidden_layers) is no part of transformers' model: it leaves those
    # tensors unread, as it does GLM-5's own layer 78; nothing else is unexpected.
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    assert all(k.startswith(mtp) for k in info["unexpected_keys"]) and not info["mismatched_keys"]
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


# --- the trained pair (assets/, tools/train_tiny.py) ---

def test_the_embedded_model_is_the_shipped_trained_checkpoint(model_dir):
    for f in sorted((ASSETS / "tiny-glm5").iterdir()):
        if not f.name.endswith(".log"):
            assert (model_dir / f.name).read_bytes() == f.read_bytes(), f.name
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["index_topk"] == 64 and cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1


def test_shipped_pair_is_bf16_and_small():
    total = sum(f.stat().st_size for d in ("tiny-glm5", "tiny-glm5-dflash") for f in (ASSETS / d).iterdir())
    assert total <= 28 * 2**20, total  # 25 MiB before the target's MTP layer (2.9 MB)
    for d in ("tiny-glm5", "tiny-glm5-dflash", "tiny-glm5-dspark"):
        with safe_open(str(ASSETS / d / "model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes <= {"BF16", "F32"} and "BF16" in dtypes


def test_embedded_draft_fits_the_embedded_model(tmp_path, model_dir):
    from glm53.models import DFlashConfig, DFlashDraft, GlmConfig, load_draft_weights

    d = ensure_embedded_draft(tmp_path)
    assert resolve_draft_path(str(d)) == d
    target = GlmConfig.from_dir(model_dir)
    cfg = DFlashConfig.from_dir(d, target)
    assert cfg.block_size == 16 and cfg.hidden_size == target.hidden_size
    load_draft_weights(DFlashDraft(cfg, target), d)  # none missing/unexpected
    assert EMBEDDED_DRAFT == "embedded:tiny-glm5-dflash"


def test_embedded_dspark_fits_the_embedded_model(tmp_path, model_dir):
    from glm53.models import DFlashDraft, GlmConfig, draft_config, load_draft_weights

    d = ensure_embedded_dspark(tmp_path)
    assert resolve_draft_path(str(d)) == d and d.name.startswith("tiny-glm5-dspark-v")
    target = GlmConfig.from_dir(model_dir)
    cfg = draft_config(d, target)
    assert cfg.algorithm == "DSPARK" and cfg.block_size == 16 and cfg.markov_rank > 0
    load_draft_weights(DFlashDraft(cfg, target), d)  # none missing/unexpected, the heads included


def test_the_trained_model_writes_python(model_dir):
    import torch
    from tokenizers import Tokenizer

    from glm53.models import ModelRunner, PageAllocator
    from glm53.server.offline import greedy_generate

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n").ids
    runner = ModelRunner.from_dir(model_dir, page_size=16, num_pages=64, device="cpu", dtype=torch.float32, progress=False)
    out = greedy_generate(runner, PageAllocator(64), [prompt], 24, ignore_eos=True)[0]
    text = tok.decode(out)
    # Python-shaped (greedy decoding of a 10M-parameter model repeats itself, but in Python)
    assert "\n    " in text and any(k in text for k in ("import ", "return", "def ", " = ", "(")), text


def test_the_random_model_stays_available(tmp_path):
    from glm53.models import GlmConfig, GlmForCausalLM, load_weights

    d = ensure_random_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["hidden_size"] == MODEL_DIMS["hidden_size"] and cfg["num_hidden_layers"] == MODEL_DIMS["num_hidden_layers"]
    load_weights(GlmForCausalLM(GlmConfig.from_dir(d)), d, progress=False)

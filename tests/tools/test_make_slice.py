"""tools/make_slice.py (glm53/support/glm5_slice.py): the GLM-5-shaped slice writer. Full widths
are checked on the config and on the meta-device model (no weights: one full-width layer is
~0.3 B parameters); the writer itself runs end to end at tiny widths (`--width` overrides), and
the loader must accept what it wrote (no missing or unexpected tensors)."""

from __future__ import annotations

import json

import torch

from glm53.models import GlmConfig, GlmForCausalLM, load_weights
from glm53.support import glm5_slice as make_slice
from tests.models.glm5_config import GLM5

ATTENTION_AND_INDEXER = ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                         "index_topk", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
                         "intermediate_size", "routed_scaling_factor", "rope_interleave", "indexer_rope_interleave")


def test_full_width_slice_config_is_glm5s():
    cfg_d = make_slice.slice_config(4, 16, 4160, dense_layers=1, eos_token_id=[4096], pad_token_id=4096)
    for k in ATTENTION_AND_INDEXER:
        assert cfg_d[k] == GLM5[k], k
    cfg = GlmConfig.from_dict(cfg_d)
    # GLM-5.2's index sharing (freq 4, offset 3): layers 0-2 full, layer 3 reuses layer 2's top-k
    assert cfg.full_layers == [0, 1, 2] and cfg.indexer_source[3] == 2
    assert cfg.full_layers == GlmConfig.from_dict({**GLM5, "index_topk_freq": 4, "index_skip_topk_offset": 3}).full_layers[:3]
    assert [cfg.is_moe(i) for i in range(4)] == [False, True, True, True]
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (16, 8, 1)
    specs = make_slice.tensor_specs(cfg_d, torch.bfloat16)
    assert specs["model.layers.1.self_attn.o_proj.weight"][0] == (6144, 64 * 256)
    assert specs["model.layers.1.mlp.experts.15.gate_proj.weight"][0] == (2048, 6144)
    assert specs["model.layers.2.self_attn.indexer.wq_b.weight"][0] == (32 * 128, 2048)
    assert not any(n.startswith("model.layers.3.self_attn.indexer.") for n in specs)
    assert specs["model.layers.1.mlp.gate.e_score_correction_bias"][1] == torch.float32
    # issue 16's slice: 4 layers, 16 experts, one dense layer, the embedded tokenizer's vocabulary
    assert abs(make_slice.parameter_count(cfg_d) / 1e9 - 2.89) < 0.01
    # fewer experts than GLM-5's top-8: every expert is routed to
    assert make_slice.slice_config(1, 2, 4160)["num_experts_per_tok"] == 2


def test_written_slice_loads(tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": [297, 299], "pad_token_id": 297}))
    for f in make_slice.TOKENIZER_FILES:
        (tok / f).write_text(f"{{\"source\": \"{f}\"}}")
    tiny = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 2,
            "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8}
    out = tmp_path / "slice"
    argv = [str(out), "--layers", "4", "--experts", "3", "--vocab", "320", "--tokenizer-from", str(tok)]
    argv += [f"--width={k}={v}" for k, v in tiny.items()]
    make_slice.main(argv)
    assert "4 layers, 3 experts, vocab 320" in capsys.readouterr().out
    cfg = GlmConfig.from_dir(out)
    assert (cfg.hidden_size, cfg.num_experts_per_tok, cfg.vocab_size, cfg.eos_token_ids) == (64, 3, 320, (297, 299))
    assert cfg.full_layers == [0, 1, 2] and cfg.index_topk == 8
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 5  # one shard per layer + embeddings/head
    for f in make_slice.TOKENIZER_FILES:
        assert (out / f).read_text() == (tok / f).read_text()
    model = GlmForCausalLM(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_weights(model, out, progress=False)  # raises on any missing or unexpected tensor
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and p.float().std() > 0 or p.numel() == 1, name
    # a pipeline stage of it loads too (layers 2-3, lm_head)
    load_weights(GlmForCausalLM(cfg, dtype=torch.bfloat16, layers=range(2, 4)), out, progress=False)

"""Tiny random GLM-5 checkpoints written by transformers (the oracle), every parameter
perturbed away from its init so that norms, biases and the router correction all matter.
`transformers` is a test-only dependency: `make_checkpoint` imports it when called."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=24,
    index_topk=8,
    index_head_dim=32,
    index_n_heads=16,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    eos_token_id=[158, 159],
    max_position_embeddings=4096,
)

# Overrides of BASE for block-FP8 tests with GLM-5-FP8's 128×128 blocks: every weight tensor
# parallelism splits gives each of tp = 2 ranks whole 128-blocks (q_b_proj rows 4 × 128, o_proj
# columns 4 × 64, expert and MLP widths 256), hidden 192 leaves partial edge blocks (128 + 64),
# and the index sharing schedule F F S F S.
FP8_WIDTHS = dict(
    hidden_size=192, num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=112, qk_rope_head_dim=16,
    v_head_dim=64, moe_intermediate_size=256, intermediate_size=256, index_topk_freq=2, index_skip_topk_offset=2,
)


def perturb_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif t.dim() == 1:  # norm weights
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            else:  # matrices (and stacked experts): unit-scale activations
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)


def make_checkpoint(path: Path, seed: int = 0, sharded: bool = False, **overrides):
    """Writes a checkpoint with save_pretrained; returns the transformers model (eval, fp32)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(**{**BASE, **overrides})
    model = GlmMoeDsaForCausalLM(cfg).eval()
    perturb_(model, seed)
    model.save_pretrained(str(path), **({"max_shard_size": "200KB"} if sharded else {}))
    return model


def quantised_embedded_model(dst: Path) -> Path:
    """The embedded trained tiny model copied to `dst` and rewritten block-FP8 in the GLM-5-FP8
    layout (`quantise_fp8_`), once: an existing `dst` is returned as it is."""
    import shutil

    from glm53.server.embedded_model import ensure_embedded_model

    if not (dst / "config.json").exists():
        shutil.copytree(ensure_embedded_model(), dst)
        quantise_fp8_(dst)
    return dst


def quantise_fp8_(path: Path, block: int = 128) -> None:
    """Rewrites the single-file checkpoint at `path` as block-FP8 in the GLM-5-FP8 layout
    (`weights.fp8_in_glm5`: the MLA projections, the indexer's wq_b and wk, every MLP and
    expert projection; e4m3 weights with fp32 `weight_scale_inv` per block × block tile, from
    `kernels.fp8_quant.quantize_fp8_blocks`), and adds the matching `quantization_config` to
    config.json. Returns nothing; the quantised names are the `*_scale_inv` tensors' weights."""
    import json

    from safetensors.torch import load_file, save_file

    from glm53.kernels.fp8_quant import quantize_fp8_blocks
    from glm53.models.weights import fp8_in_glm5
    from glm53.support.glm5_slice import FP8_QUANTIZATION_CONFIG

    sd = load_file(str(path / "model.safetensors"))
    for name in [n for n in sd if fp8_in_glm5(n)]:
        sd[name], sd[name + "_scale_inv"] = quantize_fp8_blocks(sd[name], block)
    save_file(sd, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": [block, block]}
    (path / "config.json").write_text(json.dumps(cfg))

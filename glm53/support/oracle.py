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


def quantise_fp8_(path: Path, block: int) -> None:
    """Rewrites the single-file checkpoint at `path` as block-FP8 (e4m3 weights with
    `weight_scale_inv` per block × block tile) for every 2-D `*proj.weight` except the fp32
    indexer head gates, and adds the matching `quantization_config` to config.json."""
    import json

    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    for name in [n for n in sd if n.endswith("proj.weight") and "weights_proj" not in n and sd[n].dim() == 2]:
        w = sd[name]
        r, c = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(r * block, c * block)
        padded[: w.shape[0], : w.shape[1]] = w
        tiles = padded.view(r, block, c, block)
        scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
        q = (tiles / scale[:, None, :, None]).view(r * block, c * block)[: w.shape[0], : w.shape[1]]
        sd[name] = q.to(torch.float8_e4m3fn)
        sd[name + "_scale_inv"] = scale.float()
    save_file(sd, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block], "fmt": "e4m3"}
    (path / "config.json").write_text(json.dumps(cfg))

"""Tiny random GLM-5 checkpoints written by transformers (the oracle), every parameter
perturbed away from its init so that norms, biases and the router correction all matter."""

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

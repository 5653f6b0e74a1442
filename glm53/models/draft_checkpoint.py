"""Write a random DFlash draft checkpoint in the published layout (`config.json` with Qwen3-style
dims and `dflash_config`, `model.safetensors` with the draft's tensor names) that fits a given
target checkpoint: for tests and for serving the embedded model with speculative decoding
before a trained draft exists. Deterministic for a seed; its proposals are random, not good."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from glm53.models.config import GlmConfig
from glm53.models.draft import DFlashDraft
from glm53.models.draft_config import DFlashConfig, build_target_layer_ids
from glm53.models.draft_weights import draft_checkpoint_tensors


def draft_config_dict(
    target: GlmConfig,
    *,
    n_layers: int = 1,
    block_size: int = 4,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    rope_theta: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    dspark: bool = False,
) -> dict:
    """A draft `config.json` for `target`. Defaults: the target's head count (and as many KV
    heads, so any tp the target takes splits the draft too), head_dim = hidden / heads, the
    target's dense MLP width, the published default target layers, and the last vocabulary id
    as the mask token (the published drafts use an unused padded embedding row)."""
    heads = num_heads or target.num_attention_heads
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(target.num_hidden_layers, n_layers)
    ids = list(target_layer_ids)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": num_kv_heads or heads,
        "head_dim": head_dim or target.hidden_size // heads,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta if rope_theta is not None else target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "num_target_layers": target.num_hidden_layers,
        # DSpark drafts name their section `dspark_config` (same fields; the heads' shapes are
        # the tensors').
        "dspark_config" if dspark else "dflash_config": {
            "target_layer_ids": ids,
            "mask_token_id": mask_token_id if mask_token_id is not None else target.vocab_size - 1,
        },
    }


def _init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    # Norm gains near 1 but not 1, so every norm matters; matrices scaled by fan-in so
    # activations keep unit scale through the layers.
    if name.startswith("markov_head."):
        # [V, r] each: r^-1/4 per factor gives a Markov bias w2 · w1[t] of unit scale, like the logits.
        return torch.randn(shape, generator=g) * shape[-1] ** -0.25
    if name == "confidence_head.proj.bias":
        return 0.5 * torch.randn(shape, generator=g)
    if len(shape) == 1:
        return 1.0 + 0.2 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5


def write_random_draft(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    markov_rank: int = 0,
    confidence_head: bool = False,
    **dims,
) -> Path:
    """Writes `config.json` and `model.safetensors` of a random draft fitting the target at
    `target_dir` into `out_dir` (created) and returns `out_dir`. `dims` as `draft_config_dict`.
    `markov_rank` > 0: a DSpark draft with a Markov head of that rank (and a confidence head
    with `confidence_head`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = GlmConfig.from_dir(target_dir)
    config = draft_config_dict(target, dtype=dtype, dspark=markov_rank > 0, **dims)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cfg = DFlashConfig.from_dir(out, target)  # the config must load back against its target
    cfg = dataclasses.replace(cfg, markov_rank=markov_rank, confidence_head=confidence_head)
    with torch.device("meta"):
        draft = DFlashDraft(cfg, target, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    tensors = {
        name: _init(name, shape, g).to(dtype).contiguous() for name, (shape, _) in draft_checkpoint_tensors(draft).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""Writing an MTP (NextN) layer into a GLM-5 checkpoint: the random layer tests start from, and the
state dict a trained `NextNDraft` is saved as (tools/train_mtp.py). The target's own tensors are
copied through unchanged (byte for byte); config.json gets num_nextn_predict_layers: 1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glm53.models.config import GlmConfig
from glm53.models.mtp import NextNDraft, NextNSpec

_STACK = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def mtp_state_dict(draft: NextNDraft) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of a (single-rank, non-FP8) draft: stacked experts split per expert;
    an embedding loaded from the target's (`checkpoint_name` differs) is not the layer's own."""
    out: dict[str, torch.Tensor] = {}
    for name, p in draft.named_parameters():
        if draft.checkpoint_name(name) != name:
            continue
        m = _STACK.match(name)
        if m is None:
            out[name] = p.detach().cpu().contiguous()
        else:
            for e in range(p.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = p[e].detach().cpu().contiguous()
    return out


def random_nextn(cfg: GlmConfig, seed: int, own_head: bool = False, moe: bool = True,
                 dtype: torch.dtype = torch.float32) -> NextNDraft:
    """A NextN layer with random weights (norms near 1, linears ~ 1/sqrt(fan-in))."""
    g = torch.Generator().manual_seed(seed)
    spec = NextNSpec(cfg.num_hidden_layers, moe=moe, own_head=own_head, own_embed=False, fp8=False)
    draft = NextNDraft(cfg, spec, dtype=dtype)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or ".enorm." in name or ".hnorm." in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return draft


def layer_tensors(draft: NextNDraft, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's checkpoint tensors in the dtypes the checkpoint `like` stores the target's own:
    the same dtype as the matching tensor of its last layer, else the embedding's (bf16 with an
    fp32 router bias in the embedded model)."""
    prefix = f"model.layers.{draft.spec.layer}."
    last = f"model.layers.{draft.cfg.num_hidden_layers - 1}."
    default = like["model.embed_tokens.weight"].dtype
    out = {}
    for name, t in mtp_state_dict(draft).items():
        ref = like.get(last + name[len(prefix):])
        out[name] = t.to(ref.dtype if ref is not None else default).contiguous()
    return out


def write_layer_tensors(model_dir: str | Path, layer: int, tensors: dict[str, torch.Tensor]) -> None:
    """Replaces layer `layer`'s tensors in `model_dir`'s single-file checkpoint by `tensors`
    (names model.layers.{layer}.*); config.json gets num_nextn_predict_layers: 1."""
    model_dir = Path(model_dir)
    path = model_dir / "model.safetensors"
    prefix = f"model.layers.{layer}."
    bad = [k for k in tensors if not k.startswith(prefix)]
    if bad:
        raise ValueError(f"not the MTP layer's tensors: {bad[:3]}")
    sd = {k: v for k, v in load_file(str(path)).items() if not k.startswith(prefix)}
    sd.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(sd, str(path), metadata={"format": "pt"})
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def write_mtp_layer(model_dir: str | Path, draft: NextNDraft) -> None:
    """Adds (or replaces) the MTP layer's tensors in `model_dir`'s single-file checkpoint."""
    like = load_file(str(Path(model_dir) / "model.safetensors"))
    write_layer_tensors(model_dir, draft.spec.layer, layer_tensors(draft, like))

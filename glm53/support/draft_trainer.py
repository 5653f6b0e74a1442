"""The DFlash draft's training forward (`DraftTrainer`, parameter names the checkpoint's), its
loss, its config for a target and its checkpoint writer: shared by tools/train_tiny.py (which
trains the embedded pair's draft) and tools/distill_draft.py (which self-distils it).

The recipe is the published one: random anchor positions, block [anchor token, MASK × (B − 1)]
predicting the next B − 1 tokens, loss weights exp(−(k − 1)/γ), γ = 7. `DraftTrainer.forward`
mirrors `glm53.models.draft.DFlashDraft` (KV injection of c = hidden_norm(fc(features)), k_norm +
RoPE at absolute positions, block non-causal, context strictly before the anchor, the target's
embedding and lm_head); `tools/train_tiny.py --check` verifies that on CPU against
`DFlashDraft.propose`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# The shipped draft's dimensions (tools/train_tiny.py).
DRAFT_DIMS = dict(n_layers=2, block_size=16, num_heads=4, num_kv_heads=4, head_dim=64, intermediate_size=768)
DRAFT_GAMMA = 7.0


def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):
    """Half-split (NeoX) RoPE, as `apply_rope(..., interleave=False)`; x [..., T, h, d], cos/sin [T, d/2]."""
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class _Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class _Attn(nn.Module):
    def __init__(self, h, heads, kv, hd):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv, hd
        self.q_proj = nn.Linear(h, heads * hd, bias=False)
        self.k_proj = nn.Linear(h, kv * hd, bias=False)
        self.v_proj = nn.Linear(h, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, h, bias=False)
        self.q_norm, self.k_norm = _Norm(hd), _Norm(hd)


class _MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, h, heads, kv, hd, inter):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(h), _Norm(h)
        self.self_attn = _Attn(h, heads, kv, hd)
        self.mlp = _MLP(h, inter)


class DraftTrainer(nn.Module):
    """The DFlash draft's training forward; parameter names are the checkpoint's."""

    def __init__(self, dcfg: dict):
        super().__init__()
        h = dcfg["hidden_size"]
        self.h, self.eps, self.B = h, dcfg["rms_norm_eps"], dcfg["block_size"]
        self.heads, self.kv, self.hd = dcfg["num_attention_heads"], dcfg["num_key_value_heads"], dcfg["head_dim"]
        self.mask_id = dcfg["dflash_config"]["mask_token_id"]
        self.ids = dcfg["dflash_config"]["target_layer_ids"]
        self.layers = nn.ModuleList(
            _Layer(h, self.heads, self.kv, self.hd, dcfg["intermediate_size"]) for _ in range(dcfg["num_hidden_layers"])
        )
        self.fc = nn.Linear(len(self.ids) * h, h, bias=False)
        self.hidden_norm, self.norm = _Norm(h), _Norm(h)
        inv = 1.0 / (dcfg["rope_theta"] ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, pos):
        f = pos.float()[..., None] * self.inv_freq
        return f.cos(), f.sin()

    def forward(self, ids, feats, anchors, embed, lm_head):
        """ids [R, S] tokens, feats [R, S, K·H] the target's features, anchors [R, N] (each
        in [0, S − B]). Returns logits [R, N, B − 1, V] of block positions 1 .. B − 1 (`lm_head`
        None: their final-normed hidden [R, N, B − 1, H], what DSpark's confidence head reads)."""
        R, S = ids.shape
        N, B, H = anchors.shape[1], self.B, self.h
        dev = ids.device
        c = _rms(self.fc(feats), self.hidden_norm.weight, self.eps)  # [R, S, H]
        blk = torch.full((R, N, B), self.mask_id, dtype=torch.long, device=dev)
        blk[:, :, 0] = ids.gather(1, anchors)
        bpos = (anchors[:, :, None] + torch.arange(B, device=dev)).reshape(R, N * B)
        x = F.embedding(blk.reshape(R, N * B), embed)
        ccos, csin = self.cos_sin(torch.arange(S, device=dev))
        bcos, bsin = self.cos_sin(bpos)  # [R, N·B, d/2]
        # Block j's queries see context positions < anchor_j and their own block (non-causal).
        ctx_ok = torch.arange(S, device=dev)[None, None, :] < anchors.repeat_interleave(B, 1)[:, :, None]
        jb = torch.arange(N * B, device=dev) // B
        blk_ok = (jb[:, None] == jb[None, :]).expand(R, -1, -1)
        mask = torch.cat([ctx_ok, blk_ok], dim=2)[:, None]  # [R, 1, N·B, S + N·B]
        for layer in self.layers:
            at = layer.self_attn
            xn = _rms(x, layer.input_layernorm.weight, self.eps)
            q = _rms(at.q_proj(xn).view(R, N * B, self.heads, self.hd), at.q_norm.weight, self.eps)
            q = _rope_b(q, bcos, bsin)
            kb = _rope_b(_rms(at.k_proj(xn).view(R, N * B, self.kv, self.hd), at.k_norm.weight, self.eps), bcos, bsin)
            vb = at.v_proj(xn).view(R, N * B, self.kv, self.hd)
            kc = _rope(_rms(at.k_proj(c).view(R, S, self.kv, self.hd), at.k_norm.weight, self.eps), ccos, csin)
            vc = at.v_proj(c).view(R, S, self.kv, self.hd)
            k = torch.cat([kc, kb.to(kc.dtype)], 1).transpose(1, 2)
            v = torch.cat([vc, vb.to(vc.dtype)], 1).transpose(1, 2)
            grp = self.heads // self.kv
            k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask, scale=self.hd**-0.5)
            x = x + at.o_proj(o.transpose(1, 2).reshape(R, N * B, self.heads * self.hd))
            x = x + layer.mlp(_rms(x, layer.post_attention_layernorm.weight, self.eps))
        hN = _rms(x, self.norm.weight, self.eps).view(R, N, B, H)[:, :, 1:]
        return hN if lm_head is None else F.linear(hN, lm_head)


def _rope_b(x, cos, sin):
    """RoPE with per-row positions: x [R, T, h, d], cos/sin [R, T, d/2]."""
    c, s = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def draft_loss(logits, ids, anchors, B, gamma=DRAFT_GAMMA):
    R, N = anchors.shape
    labels = ids.gather(1, (anchors[:, :, None] + torch.arange(1, B, device=ids.device)).reshape(R, -1)).view(R, N, B - 1)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(R, N, B - 1)
    w = torch.exp(-torch.arange(B - 1, device=ids.device, dtype=torch.float32) / gamma)
    acc = (logits.argmax(-1) == labels).float()
    # accepted length per block under teacher forcing (cumprod of matches), for the curve only
    return (ce * w).sum(-1).mean() / w.sum(), torch.cumprod(acc, -1).sum(-1).mean()


def draft_config(target_dir: Path, dims: dict | None = None):
    """The draft's config for the target in `target_dir`; `dims` default to `DRAFT_DIMS`."""
    from glm53.models.config import GlmConfig
    from glm53.models.draft_checkpoint import draft_config_dict

    t = GlmConfig.from_dir(target_dir)
    L = t.num_hidden_layers
    return draft_config_dict(t, target_layer_ids=[1, L // 2, L - 2], dtype=torch.bfloat16,
                             **(DRAFT_DIMS if dims is None else dims))


def save_draft(draft: DraftTrainer, dcfg: dict, out: Path, dtype=torch.bfloat16) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    dcfg = {**dcfg, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")
    sd = {k: v.detach().to(dtype).cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})

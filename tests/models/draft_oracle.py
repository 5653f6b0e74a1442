"""Random DFlash draft checkpoints for tests, and a plain-torch reference of the draft written
from the published formulas (docs: /work/shared/reference/dflash.md §1), independent of the
model code and kernels: c = hidden_norm(fc(concat h)); per layer K = RoPE(k_norm(W_k ·)),
V = W_v · of the context c and of the block; block queries attend to [context ; block]
(non-causal, GQA, scale head_dim^-0.5); SwiGLU MLP; final norm; the target's lm_head; argmax."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from glm53.models.draft_checkpoint import write_random_draft

# A small GQA draft for the oracle target (hidden 64, 5 layers, vocab 160).
DRAFT_DIMS = dict(n_layers=2, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)


def make_draft_checkpoint(path: Path, target_dir: Path, seed: int = 0, **dims) -> "RefDraft":
    """Writes an fp32 random draft fitting `target_dir`; returns its reference implementation."""
    write_random_draft(path, target_dir, seed=seed, dtype=torch.float32, **{**DRAFT_DIMS, **dims})
    return RefDraft(path, target_dir)


def target_and_draft(root: Path, seed: int) -> tuple[Path, Path]:
    """A tiny random target with index sharing (root/target, `seed`) and a draft of it reading
    layers 1, 2 and 4 (root/draft, `seed` + 1): the CPU draft-path tests' pair."""
    from glm53.support.oracle import make_checkpoint

    make_checkpoint(root / "target", seed=seed, index_topk_freq=2, index_skip_topk_offset=2)
    make_draft_checkpoint(root / "draft", root / "target", seed=seed + 1, target_layer_ids=[1, 2, 4])
    return root / "target", root / "draft"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, d] at integer positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos.double()[:, None] * inv
    emb = torch.cat([f, f], dim=-1)
    cos, sin = emb.cos()[:, None].float(), emb.sin()[:, None].float()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


class RefDraft:
    def __init__(self, draft_dir: Path, target_dir: Path):
        self.cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        tensors = load_file(str(Path(draft_dir) / "model.safetensors"))
        self.w = {k.removeprefix("model."): v.float() for k, v in tensors.items()}
        target = load_file(str(Path(target_dir) / "model.safetensors"))
        self.embed = target["model.embed_tokens.weight"].float()
        self.lm_head = target["lm_head.weight"].float()
        c = self.cfg
        section = c.get("dspark_config") or c["dflash_config"]
        self.ids = section["target_layer_ids"]
        self.mask_id = section["mask_token_id"]
        self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def context(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """c [S, H] from the features (layer id -> [S, H]) of every feature layer."""
        cat = torch.cat([features[i] for i in self.ids], dim=-1)
        return _rms(cat @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)

    def _kv(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"layers.{layer}.self_attn."
        k = (x @ self.w[p + "k_proj.weight"].T).view(len(x), self.nkv, self.hd)
        k = _rope(_rms(k, self.w[p + "k_norm.weight"], self.eps), pos, self.theta)
        return k, (x @ self.w[p + "v_proj.weight"].T).view(len(x), self.nkv, self.hd)

    def context_kv(self, c: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, K and V [S, kv_heads, head_dim] of the context rows c at positions pos."""
        return [self._kv(i, c, pos) for i in range(self.cfg["num_hidden_layers"])]

    def propose(
        self, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], last_token: int, start_pos: int, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B-1], logits [B-1, V]) of one block over the visible context K/V."""
        ids = torch.tensor([last_token] + [self.mask_id] * (block - 1))
        pos = start_pos + torch.arange(block)
        x = self.embed[ids]
        g = self.nh // self.nkv
        for i, (ck, cv) in enumerate(ctx_kv):
            p = f"layers.{i}."
            h = _rms(x, self.w[p + "input_layernorm.weight"], self.eps)
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(block, self.nh, self.hd)
            q = _rope(_rms(q, self.w[p + "self_attn.q_norm.weight"], self.eps), pos, self.theta)
            bk, bv = self._kv(i, h, pos)
            k, v = torch.cat([ck, bk]), torch.cat([cv, bv])  # [T + B, kv, d]
            out = []
            for head in range(self.nh):
                s = (q[:, head] @ k[:, head // g].T) * self.hd**-0.5
                out.append(torch.softmax(s, dim=-1) @ v[:, head // g])
            x = x + torch.cat(out, dim=-1) @ self.w[p + "self_attn.o_proj.weight"].T
            h = _rms(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
            m = F.silu(h @ self.w[p + "mlp.gate_proj.weight"].T) * (h @ self.w[p + "mlp.up_proj.weight"].T)
            x = x + m @ self.w[p + "mlp.down_proj.weight"].T
        self.hidden = _rms(x, self.w["norm.weight"], self.eps)[1:]  # what DSpark's confidence head reads
        logits = self.hidden @ self.lm_head.T
        return logits.argmax(-1), logits

    def dspark(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: int,
               threshold: float) -> tuple[list[int], int]:
        """DSpark's greedy block from the formulas (the draft's Markov and confidence tensors):
        token_i = argmax(logits_i + markov_w2 · markov_w1[token_{i−1}]) from token_0 = anchor;
        the block ends before the first i with sigmoid(proj([h_i, markov_w1[token_{i−1}]])) <
        threshold. (tokens [B − 1], how many the cut keeps)."""
        w1, w2 = self.w["markov_head.markov_w1.weight"], self.w["markov_head.markov_w2.weight"]
        tokens, keep, prev, cut = [], len(logits), anchor, False
        self.confidences = []
        for i in range(len(logits)):
            e = w1[prev]
            tok = int(torch.argmax(logits[i] + w2 @ e))
            if "confidence_head.proj.weight" in self.w:
                proj = self.w["confidence_head.proj.weight"][0]
                z = torch.cat([hidden[i], e]) @ proj + self.w["confidence_head.proj.bias"][0]
                self.confidences.append(1 / (1 + math.exp(-float(z))))
                if threshold > 0 and not cut and self.confidences[-1] < threshold:
                    keep, cut = i, True
            tokens.append(tok)
            prev = tok
        return tokens, keep


def write_successor_heads(draft_dir: Path, succ: dict[int, int], confident: dict[int, bool], vocab: int,
                          scale: float = 30.0) -> None:
    """Turn the DFlash draft at `draft_dir` into a DSpark draft whose Markov head makes every
    token t of `succ` propose succ[t] next (a bias of scale² on it, far above any draft logit),
    and whose confidence head rates position i by the token before it only: high (sigmoid 6)
    after a token `confident` marks True, low (sigmoid −6) after one marked False. Rank: the
    number of distinct tokens in `succ` (one coordinate each). Proposal chains and cuts are
    then computable from `succ` and `confident` alone (`chain_block`)."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["dspark_config"] = cfg.pop("dflash_config")
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = load_file(str(draft_dir / "model.safetensors"))
    dtype = tensors["fc.weight"].dtype
    keys = sorted(succ)
    r, h = len(keys), cfg["hidden_size"]
    w1, w2, proj = torch.zeros(vocab, r), torch.zeros(vocab, r), torch.zeros(1, h + r)
    for j, t in enumerate(keys):
        w1[t, j] = scale
        w2[succ[t], j] = scale
        proj[0, h + j] = (6.0 if confident.get(t, True) else -6.0) / scale
    tensors.update({"markov_head.markov_w1.weight": w1.to(dtype), "markov_head.markov_w2.weight": w2.to(dtype),
                    "confidence_head.proj.weight": proj.to(dtype),
                    "confidence_head.proj.bias": torch.zeros(1, dtype=dtype)})
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})


def chain_block(anchor: int, n: int, succ: dict[int, int], confident: dict[int, bool]) -> list[int]:
    """The drafts of a block of n verified tokens from `write_successor_heads`' heads with the
    confidence cut on: succ applied from the anchor, ending before a position whose predecessor
    is not confident."""
    out, prev = [], anchor
    for _ in range(n - 1):
        if not confident.get(prev, True):
            break
        prev = succ[prev]
        out.append(prev)
    return out


def chain_verify_steps(first: int, greedy: list[int], block: int, succ: dict[int, int],
                       confident: dict[int, bool]) -> list[int]:
    """Tokens committed per verify step of a greedy decode whose target emits `greedy` (its first
    token `first` from prefill) and whose drafts are `chain_block`'s, to len(greedy) tokens."""
    out, steps = [first], []
    while len(out) < len(greedy):
        n = min(block, len(greedy) - len(out))
        drafts = chain_block(out[-1], n, succ, confident)
        a = 0
        while a < len(drafts) and drafts[a] == greedy[len(out) + a]:
            a += 1
        steps.append(a + 1)
        out = greedy[: len(out) + a + 1]
    return steps

"""Training DSpark's heads (tools/distill_draft.py --dspark-rank): the low-rank Markov head and the
confidence head, over the target's own greedy continuations, either on a frozen DFlash draft or
jointly with the draft's body (`--dspark-joint`).

Frozen: the heads are what DSpark adds; the shipped DFlash draft already predicts each block
position from the context alone, and a Markov bias that starts at zero (markov_w2 = 0) makes the
untrained DSpark draft exactly the DFlash draft, so training can only move it from there.

Joint: a frozen body's logits at position k already average over the tokens that may precede it,
so a context-free bigram bias added on top counts the predecessor twice where the context had
already made it likely (measured: heads on a frozen draft gain 6 % of τ on their own corpus and
lose 1–6 % on other code). Trained together, the body learns the part of each position that the
bias does not supply. The body then differs from the DFlash draft it started from, so a joint
DSpark checkpoint carries its own body (`save_draft` + `add_heads`).

Per anchor p and block position k = 1 .. B − 1 (teacher-forced, as the accepted prefix of a block
is the target's own tokens): the Markov logits `base_k + markov_w2 · markov_w1[x_{p+k−1}]` are
trained by cross-entropy on x_{p+k} with the DFlash weights exp(−(k − 1)/γ); the confidence head
`sigmoid(proj([h_k, markov_w1[x_{p+k−1}]]))` by binary cross-entropy on whether that position's
argmax is right (only positions whose predecessors are all right can be accepted, and those are
exactly the teacher-forced ones). Held-out τ replays the greedy decode loop with the DSpark chain
(each position's bias from the token chosen before it) and the confidence cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from glm53.support.distill_data import Data
from glm53.support.draft_trainer import DRAFT_GAMMA, DraftTrainer
from glm53.support.draft_distill import draft_feats


class DSparkHeads(nn.Module):
    """The heads' parameters under their checkpoint names (`markov_head.markov_w1.weight`, ...)."""

    def __init__(self, vocab: int, hidden: int, rank: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Module()
        self.markov_head.markov_w1.weight = nn.Parameter(torch.randn(vocab, rank, generator=g) * rank ** -0.5)
        self.markov_head.markov_w2 = nn.Module()
        self.markov_head.markov_w2.weight = nn.Parameter(torch.zeros(vocab, rank))  # starts as DFlash
        self.confidence_head = nn.Module()
        self.confidence_head.proj = nn.Linear(hidden + rank, 1)
        with torch.no_grad():
            self.confidence_head.proj.weight.zero_()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w1.weight[tokens]

    def logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """base [..., V] + markov_w2 · markov_w1[prev] ([...])."""
        return base + self.embed(prev) @ self.markov_head.markov_w2.weight.T

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence before the sigmoid; the Markov embedding enters detached (the confidence
        head learns to read it, it does not shape it)."""
        return self.confidence_head.proj(torch.cat([h.float(), self.embed(prev).detach()], dim=-1)).squeeze(-1)


def block_hidden(draft: DraftTrainer, x, f, anchors, embed) -> torch.Tensor:
    """The frozen draft's final-normed block hidden [R, N, B − 1, H] in fp32 (its logits are lm_head
    of it). On a GPU the draft runs under bf16 autocast, as distill_draft trains and replays it (the
    features are stored bf16 there)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        return draft(x, f, anchors, embed, None).float()


def heads_loss(heads: DSparkHeads, h: torch.Tensor, lm_head: torch.Tensor, x: torch.Tensor, anchors: torch.Tensor,
               B: int, gamma: float = DRAFT_GAMMA, train_body: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Markov CE, confidence BCE, accepted drafts per block under teacher forcing) for the blocks
    at `anchors` [R, N] of sequences `x` [R, S], whose block hidden is `h` [R, N, B − 1, H].
    `train_body`: the CE's gradient also flows into `h` (joint training); the confidence head
    reads `h` detached either way (it learns to judge the draft, not to shape it)."""
    R, N = anchors.shape
    k = torch.arange(1, B, device=x.device)
    labels = x.gather(1, (anchors[:, :, None] + k).reshape(R, -1)).view(R, N, B - 1)
    prev = x.gather(1, (anchors[:, :, None] + k - 1).reshape(R, -1)).view(R, N, B - 1)
    with torch.set_grad_enabled(train_body and torch.is_grad_enabled()):
        base = F.linear(h, lm_head).float()
    logits = heads.logits(base, prev).float()
    w = torch.exp(-(k - 1).float() / gamma)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(R, N, B - 1)
    right = (logits.detach().argmax(-1) == labels).float()
    bce = F.binary_cross_entropy_with_logits(heads.confidence_logit(h.detach(), prev).float(), right)
    return (ce * w).sum(-1).mean() / w.sum(), bce, torch.cumprod(right, -1).sum(-1).mean()


@torch.no_grad()
def replay_tau_dspark(draft: DraftTrainer, heads: DSparkHeads | None, held: Data, w, device, B: int, new: int,
                      threshold: float = 0.0, rows: int = 128) -> tuple[float, float]:
    """(τ, drafts verified per step) of the greedy decode loop replayed on the held-out greedy
    continuations: the block's proposals are the DSpark chain (DFlash's argmax without `heads`),
    cut before the first position whose confidence is below `threshold`."""
    embed, lm_head = w
    steps = toks = drafted = 0
    ar = torch.arange(1, B, device=device)
    for s in range(0, held.m, rows):
        x, f = held.tokens[s: s + rows], draft_feats(held.feats[s: s + rows], device)
        p = held.plen[s: s + rows].to(device).clone()
        end = p + new - 1
        live = torch.ones(len(x), dtype=torch.bool, device=device)
        while live.any():
            idx = live.nonzero().squeeze(1)
            trained_b, draft.B = draft.B, B
            h = block_hidden(draft, x[idx], f[idx], p[idx, None], embed)[:, 0]  # [r, B − 1, H]
            draft.B = trained_b
            base = F.linear(h, lm_head).float()
            prev = x[idx].gather(1, p[idx, None])[:, 0]
            props, keep = [], torch.full((len(idx),), B - 1, device=device)
            cut = torch.zeros(len(idx), dtype=torch.bool, device=device)
            for i in range(B - 1):
                lg = base[:, i] if heads is None else heads.logits(base[:, i], prev)
                if heads is not None and threshold > 0:
                    low = torch.sigmoid(heads.confidence_logit(h[:, i], prev)) < threshold
                    keep = torch.where(low & ~cut, i, keep)
                    cut |= low
                prev = lg.argmax(-1)
                props.append(prev)
            prop = torch.stack(props, 1)
            lab = x[idx].gather(1, p[idx, None] + ar)
            ok = (prop == lab) & (ar[None] - 1 < keep[:, None])
            acc = torch.cumprod(ok.long(), -1).sum(-1)
            adv = torch.minimum(acc + 1, end[idx] - p[idx])
            p[idx] += adv
            steps, toks, drafted = steps + len(idx), toks + adv.sum().item(), drafted + keep.sum().item()
            live = p < end
    return toks / steps, drafted / steps


def load_heads(src: Path, rank: int = 0) -> DSparkHeads:
    """The heads of the DSpark checkpoint at `src` (rank from `markov_w1`; the confidence head
    zero when the checkpoint has none), in fp32 for training. `rank` above the checkpoint's widens
    the Markov head without changing what it computes (`widen`)."""
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()
          if k.startswith(("markov_head.", "confidence_head."))}
    if "markov_head.markov_w1.weight" not in sd:
        raise ValueError(f"{src}: no markov_head.markov_w1.weight (not a DSpark checkpoint)")
    vocab, own = sd["markov_head.markov_w1.weight"].shape
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    heads = DSparkHeads(vocab, hidden, own)
    missing, unexpected = heads.load_state_dict(sd, strict=False)
    if unexpected or any(not k.startswith("confidence_head.") for k in missing):
        raise ValueError(f"{src}: heads tensors do not fit rank {own}: missing {missing}, unexpected {unexpected}")
    return widen(heads, rank) if rank > own else heads


def widen(heads: DSparkHeads, rank: int, seed: int = 0) -> DSparkHeads:
    """The same heads at a higher Markov rank: the new columns of `markov_w1` random (as a fresh
    head's), those of `markov_w2` and the confidence head's weights on them zero, so the bias and
    the confidence are unchanged until training moves them (a trained head keeps what it learnt)."""
    w1, w2 = heads.markov_head.markov_w1.weight.data, heads.markov_head.markov_w2.weight.data
    (vocab, old), hidden = w1.shape, heads.confidence_head.proj.weight.shape[1] - w1.shape[1]
    out = DSparkHeads(vocab, hidden, rank, seed=seed)
    with torch.no_grad():
        out.markov_head.markov_w1.weight[:, :old] = w1
        out.markov_head.markov_w2.weight[:, :old] = w2
        out.confidence_head.proj.weight[:, : hidden + old] = heads.confidence_head.proj.weight
        out.confidence_head.proj.bias.copy_(heads.confidence_head.proj.bias)
    return out


def save_dspark(draft_dir: Path, heads: DSparkHeads, out: Path, dtype=torch.bfloat16) -> None:
    """The DFlash checkpoint at `draft_dir` plus the heads, its config section renamed
    `dspark_config`, written to `out`. (`out` may be `draft_dir`: a joint draft's body is saved
    first, then its heads are added.)"""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["dspark_config"] = cfg.pop("dflash_config")
    sd = {k: v.clone() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sd.update({k: v.detach().to(dtype).cpu().contiguous() for k, v in heads.state_dict().items()})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})

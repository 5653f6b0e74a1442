"""The pieces of tools/distill_draft.py that decide what the self-distilled DFlash draft learns
and how it is judged (tests/tools/test_distill_draft.py checks them): anchors only where the labels
are the target's own tokens (`sample_anchors`); a deeper draft that starts as the function of the
draft it grows from (`init_from`); and two held-out numbers over `Data` of greedy continuations:
"accepted", the mean matching prefix of the draft's block against the target's tokens over random
anchors (teacher-forced, `held_accept`), and τ, the greedy decode loop replayed on the sequences
(`replay_tau`): from the first generated token, the draft proposes a block at the last committed
position, the matching prefix plus the target's token are committed, and the next block starts
there. The continuation is the target's greedy output, so this is the τ the server's greedy loop
gets, up to feature rounding (bf16 features here, float32 in serving).
"""

from __future__ import annotations

from pathlib import Path

import torch

from glm53.support.distill_data import Data
from glm53.support.draft_trainer import DraftTrainer, draft_loss
from glm53.support.training import log


def init_from(draft: DraftTrainer, init_dir: Path | None) -> None:
    """Copy the init draft's tensors (same names, same shapes); layers it lacks keep their init
    but with o_proj and down_proj zeroed, so they start as identities on the residual stream."""
    if init_dir is None:
        return
    from safetensors.torch import load_file

    sd = load_file(str(init_dir / "model.safetensors"))
    own = draft.state_dict()
    with torch.no_grad():
        for n, t in own.items():
            if n in sd and sd[n].shape == t.shape:
                t.copy_(sd[n].float())
            elif n.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
    log(f"draft init from {init_dir}: {sum(n in sd for n in own)}/{len(own)} tensors")


def sample_anchors(starts: torch.Tensor, n: int, S: int, B: int, g: torch.Generator) -> torch.Tensor:
    """[R, n] sorted anchors, row r's drawn without replacement from [starts[r], S − B]."""
    pos = torch.arange(S, device=starts.device)
    ok = (pos[None] >= starts[:, None]) & (pos[None] <= S - B)
    score = torch.rand(len(starts), S, generator=g, device=starts.device).masked_fill(~ok, -1.0)
    return score.topk(n, -1).indices.sort(-1).values


def draft_feats(f: torch.Tensor, device) -> torch.Tensor:
    return f if device.type == "cuda" else f.float()  # CPU: no autocast, the draft is fp32


@torch.no_grad()
def held_accept(draft, held: Data, w, a, device, B: int) -> tuple[float, float]:
    """(γ-weighted loss, mean accepted drafts per block) over the held-out sequences."""
    g = torch.Generator(device=device).manual_seed(97)
    tl = ta = k = 0
    trained_b, draft.B = draft.B, B
    for s in range(0, held.m, a.batch):
        x = held.tokens[s: s + a.batch]
        anchors = sample_anchors(held.starts[s: s + a.batch].to(device), a.anchors, x.shape[1], B, g)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, acc = draft_loss(draft(x, draft_feats(held.feats[s: s + a.batch], device), anchors, *w), x, anchors, B)
        tl, ta, k = tl + loss.item(), ta + acc.item(), k + 1
    draft.B = trained_b
    return tl / k, ta / k


@torch.no_grad()
def replay_tau(draft, held: Data, w, device, B: int, new: int, rows: int = 256) -> float:
    """τ of the greedy decode loop replayed on the held-out greedy continuations (see the module
    doc): tokens committed per verify step over `new` − 1 tokens after the first."""
    trained_b, draft.B = draft.B, B
    steps = toks = 0
    ar = torch.arange(1, B, device=device)
    for s in range(0, held.m, rows):
        x, f = held.tokens[s: s + rows], draft_feats(held.feats[s: s + rows], device)
        p = held.plen[s: s + rows].to(device).clone()  # the first generated token: the first bonus
        end = p + new - 1
        if (end + B - 1 >= x.shape[1]).any():
            raise ValueError(f"held-out sequences of {x.shape[1]} tokens are too short for {new} new tokens at block {B}")
        live = torch.ones(len(x), dtype=torch.bool, device=device)
        while live.any():
            idx = live.nonzero().squeeze(1)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = draft(x[idx], f[idx], p[idx, None], *w)
            prop = logits[:, 0].argmax(-1)
            lab = x[idx].gather(1, p[idx, None] + ar)
            acc = torch.cumprod((prop == lab).long(), -1).sum(-1)
            adv = torch.minimum(acc + 1, end[idx] - p[idx])
            p[idx] += adv
            steps, toks = steps + len(idx), toks + adv.sum().item()
            live = p < end
    draft.B = trained_b
    return toks / steps

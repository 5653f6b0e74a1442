"""Self-distil the embedded model's DFlash draft: train it on what the frozen target generates.

    PYTHONPATH=. python tools/distill_draft.py --target assets/tiny-glm5 --init-draft assets/tiny-glm5-dflash \
        --out OUT [--gen-seconds 90] [--draft-seconds 200] [--layers 3]

Why: a draft trained on corpus text learns to predict the *corpus*; what speculative decoding
needs is the target's own next B − 1 tokens. Greedy decoding is deterministic, so in a sequence
[prompt, greedy continuation] the B − 1 tokens after any position of the continuation are exactly
what the target would emit from there: such sequences are exact DFlash training targets.

1. Generation (`glm53.models.ModelRunner`, the serving model, float32, batched): prompts are
   random windows of the held-in standard-library corpus (the split of tools/train_tiny.py); each
   round uses one prompt length (no padding) and continues every prompt to `--seq` tokens. Rounds
   cycle through three kinds: greedy; T = 1 sampling for the first 24 tokens then greedy (other
   states than the corpus's, greedy labels); T = 0.8 sampling throughout (for sampled serving).
   Anchors are drawn only where the labels are the target's own tokens (after the prompt, after
   the sampled head for the second kind).
2. Training: the DFlash recipe of tools/train_tiny.py (features of the target's layers
   `target_layer_ids` from transformers' `GlmMoeDsaForCausalLM` on the same weights, random
   anchors, block [anchor token, MASK × (B − 1)], loss weights exp(−(k − 1)/γ); every 4th step
   uses block B/2, since serving may verify fewer than B positions); the draft starts
   from `--init-draft` (a deeper draft gets extra layers whose output projections start at zero,
   so it starts as the init draft's function).
3. Held-out: greedy continuations of held-out prompts; "accepted" is the mean matching prefix of
   the draft's block against the target's greedy tokens over random anchors: what a verify step
   starting there would accept (up to bf16 feature rounding). τ − 1 in decoding is lower, as
   verify steps start more often where the draft misses (tools/eval_dflash.py measures τ).

Deterministic seeds; the generation rounds and draft steps follow the time budgets (printed), and
`--gen-rounds/--draft-steps` set to the printed counts repeat the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.train_tiny import (  # noqa: E402
    DRAFT_DIMS, DraftTrainer, StepBudget, build_target, draft_loss, held_out, load_target, log, lr_at,
    save_draft, stdlib_files, target_features,
)

KINDS = ("greedy", "sampled head", "sampled")
SAMPLED_HEAD = 24


def load_hf_target(tdir: Path, device):
    """transformers' GlmMoeDsaForCausalLM with the checkpoint's weights (per-expert tensors
    stacked back into gate_up_proj / down_proj), frozen, eval mode."""
    cfg = json.loads((tdir / "config.json").read_text())
    model = build_target(cfg, torch.device("cpu"))
    load_target(model, tdir)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def corpus_streams(tdir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    files = stdlib_files()
    out = []
    for part in ([f for f in files if not held_out(f[0])], [f for f in files if held_out(f[0])]):
        ids: list[int] = []
        for enc in tok.encode_batch([t for _, t in part]):
            ids.extend(enc.ids)
            ids.append(eos)
        out.append(torch.tensor(ids, dtype=torch.long))
    return out[0], out[1]


@torch.no_grad()
def generate(runner, prompts: torch.Tensor, total: int, kind: str, g: torch.Generator, chunk: int = 128) -> torch.Tensor:
    """Continue every prompt ([n, P]) to `total` tokens with the target (the serving model's paged
    decode); `kind` as KINDS. Returns [n, total] on the CPU."""
    from glm53.models import PageAllocator, SeqChunk

    n, plen = prompts.shape
    alloc = PageAllocator(runner.pools.num_pages)
    pages = [alloc.alloc(runner.pages_needed(total)) for _ in range(n)]
    seqs = prompts.tolist()
    last = []
    for s in range(0, n, chunk):  # prefill in chunks: bounded attention workspace
        last.extend(lg[-1] for lg in runner.forward([SeqChunk(seqs[i], 0, pages[i]) for i in range(s, min(n, s + chunk))]))
    logits = torch.stack(last)
    for step in range(total - plen):
        temp = {"greedy": 0.0, "sampled head": 1.0 if step < SAMPLED_HEAD else 0.0, "sampled": 0.8}[kind]
        if temp == 0.0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temp, -1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=g).squeeze(1).to(logits.device)
        nxt = nxt.tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        if len(seqs[0]) == total:
            break
        out = runner.forward([SeqChunk([seqs[i][-1]], len(seqs[i]) - 1, pages[i]) for i in range(n)])
        logits = torch.cat([lg[-1:] for lg in out])
    return torch.tensor(seqs, dtype=torch.long)


def anchor_start(plen: int, kind: str) -> int:
    """First anchor position whose next tokens are the target's own (greedy, or sampled for the
    "sampled" kind): the anchor token may be the prompt's last."""
    return plen - 1 + (SAMPLED_HEAD if kind == "sampled head" else 0)


def build_data(runner, stream: torch.Tensor, a, seconds: float, rounds: int, seed: int, kinds=KINDS):
    """Rounds of generated sequences until `rounds` (if set) or `seconds` are spent. Returns
    (seqs [M, seq], first anchor [M], greedy flag [M])."""
    g = torch.Generator().manual_seed(seed)
    seqs, starts, greedy = [], [], []
    t0 = time.time()
    r = 0
    lens = [n for n in (32, 64, 128, 200, 256) if n <= a.seq - 3 * SAMPLED_HEAD] or [a.seq // 4]
    while (r < rounds) if rounds else (time.time() - t0 < seconds):
        kind = kinds[r % len(kinds)]
        plen = lens[int(torch.randint(len(lens), (), generator=g))]
        at = torch.randint(0, len(stream) - plen, (a.gen_batch,), generator=g)
        prompts = torch.stack([stream[s : s + plen] for s in at.tolist()])
        out = generate(runner, prompts, a.seq, kind, g)
        seqs.append(out)
        starts.append(torch.full((len(out),), anchor_start(plen, kind)))
        greedy.append(torch.full((len(out),), kind != "sampled"))
        r += 1
        log(f"gen round {r:3d}: {kind:<12} prompt {plen:3d} -> {a.seq} tokens x {len(out)}, "
            f"{sum(len(s) for s in seqs) * (a.seq) / (time.time() - t0) / 1e3:.1f}K tok/s incl. prompts, {time.time() - t0:.0f}s")
    log(f"generated {r} rounds ({sum(len(s) for s in seqs)} sequences) in {time.time() - t0:.0f}s")
    return torch.cat(seqs), torch.cat(starts), torch.cat(greedy)


def sample_anchors(starts: torch.Tensor, n: int, seq: int, B: int, g: torch.Generator) -> torch.Tensor:
    """[R, n] sorted anchors, row r's drawn without replacement from [starts[r], seq − B]."""
    rows = []
    for s in starts.tolist():
        span = seq - B - s + 1
        rows.append(torch.randperm(span, generator=g)[:n] + s)
    return torch.stack(rows).sort(-1).values


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


@torch.no_grad()
def held_accept(draft, model, seqs, starts, a, device, B: int) -> tuple[float, float]:
    """(γ-weighted loss, mean accepted length per block) over held-out generated sequences."""
    g = torch.Generator().manual_seed(97)
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    tl, ta, k = 0.0, 0.0, 0
    trained_b, draft.B = draft.B, B  # a smaller block: fewer MASK positions, as num_draft_tokens < B serves
    for s in range(0, len(seqs), a.batch):
        x = seqs[s : s + a.batch].to(device)
        anchors = sample_anchors(starts[s : s + a.batch], a.anchors, a.seq, B, g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            feats, _ = target_features(model, x, draft.ids)
            loss, acc = draft_loss(draft(x, feats, anchors, embed, lm_head), x, anchors, B)
        tl, ta, k = tl + loss.item(), ta + acc.item(), k + 1
    draft.B = trained_b
    return tl / k, ta / k


def train(draft, model, data, held, a, device) -> None:
    seqs, starts, _ = data
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    opt = torch.optim.AdamW(draft.parameters(), lr=a.draft_lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    g = torch.Generator().manual_seed(2)
    seqs_d = seqs.to(device)
    full_b = draft.B
    budget = StepBudget(a.draft_steps, a.draft_seconds, "draft")
    step = 0
    while step < budget.total:
        budget.tick(step)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, budget.total, a.draft_lr, 30)
        idx = torch.randint(0, len(seqs), (a.batch,), generator=g)
        x = seqs_d[idx.to(device)]
        # every 4th step a half block, so serving with num_draft_tokens < B is trained too
        draft.B = full_b // 2 if step % 4 == 3 else full_b
        anchors = sample_anchors(starts[idx], a.anchors, a.seq, draft.B, g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            with torch.no_grad():
                feats, _ = target_features(model, x, draft.ids)
            loss, acc = draft_loss(draft(x, feats, anchors, embed, lm_head), x, anchors, draft.B)
        draft.B = full_b
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == budget.total - 1:  # (a step % 4 == 0: full block)
            msg = f"draft step {step:5d} loss {loss.item():.3f} accepted {acc.item():.2f}"
            if step % 500 == 0 or step == budget.total - 1:
                hl, ha = held_accept(draft, model, *held[:2], a, device, draft.B)
                msg += f" | held-out loss {hl:.3f} accepted {ha:.2f}"
            log(msg + f" {budget.elapsed():.0f}s")
        step += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--init-draft", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT/tiny-glm5-dflash")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seq", type=int, default=448, help="tokens per generated sequence (prompt + continuation)")
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--gen-seconds", type=float, default=90)
    ap.add_argument("--gen-rounds", type=int, default=0)
    ap.add_argument("--held-rounds", type=int, default=1)
    ap.add_argument("--draft-seconds", type=float, default=200)
    ap.add_argument("--draft-steps", type=int, default=0)
    ap.add_argument("--draft-lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--corpus", type=Path, help="a Python standard library source tree (default: this Python's)")
    a = ap.parse_args()
    if a.corpus:
        os.environ["GLM53_CORPUS"] = str(a.corpus)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # generation in fp32 as served
    t0 = time.time()
    from glm53.models import ModelRunner

    train_s, held_s = corpus_streams(a.target)
    log(f"corpus: {len(train_s)} held-in tokens, {len(held_s)} held-out tokens, {time.time() - t0:.0f}s")
    pages = a.gen_batch * -(-a.seq // 16) + 16
    runner = ModelRunner.from_dir(a.target, page_size=16, num_pages=pages, device=str(device), dtype=torch.float32,
                                  progress=False)
    held = build_data(runner, held_s, a, 0, a.held_rounds, seed=11, kinds=("greedy",))
    data = build_data(runner, train_s, a, a.gen_seconds, a.gen_rounds, seed=10)
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = True
    model = load_hf_target(a.target, device)
    from tools.train_tiny import draft_config

    dcfg = draft_config(a.target)
    dcfg.update(num_hidden_layers=a.layers, block_size=a.block_size)
    assert dcfg["intermediate_size"] == DRAFT_DIMS["intermediate_size"]
    torch.manual_seed(7)
    draft = DraftTrainer(dcfg)
    init_from(draft, a.init_draft)
    draft.to(device)
    log(f"draft: {a.layers} layers, block {a.block_size}, {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, "
        f"target_layer_ids {draft.ids}")
    hl, ha = held_accept(draft, model, *held[:2], a, device, draft.B)
    log(f"held-out before: loss {hl:.3f} accepted {ha:.2f}")
    train(draft, model, data, held, a, device)
    res = {}
    for B in sorted({4, 8, a.block_size}):
        res[f"held_loss_B{B}"], res[f"held_accepted_B{B}"] = held_accept(draft, model, *held[:2], a, device, B)
    log("results " + json.dumps(res))
    save_draft(draft, dcfg, a.out / "tiny-glm5-dflash")
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

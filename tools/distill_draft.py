"""Self-distil the embedded model's DFlash draft: train it on what the frozen target generates.

    PYTHONPATH=. python tools/distill_draft.py --target assets/tiny-glm5 --init-draft assets/tiny-glm5-dflash \
        --out OUT [--layers 3 5] [--gen-seconds 120] [--draft-seconds 150]

Why: a draft trained on corpus text learns to predict the *corpus*; what speculative decoding
needs is the target's own next B − 1 tokens. Greedy decoding is deterministic, so in a sequence
[prompt, greedy continuation] the B − 1 tokens after any position of the continuation are exactly
what the target would emit from there: such sequences are exact DFlash training targets.

1. Data (glm53/support/distill_data.py): rounds of `--gen-batch` prompts (random windows of the
   held-in standard-library corpus, glm53/support/corpus.py's split) continued in lockstep to
   `--seq` tokens by the serving model in float32, which also captures the draft's feature layers,
   so training reads stored features (bf16) and runs no target forward.
2. Training: the DFlash recipe of tools/train_tiny.py (glm53/support/draft_trainer.py: random
   anchors from the first position whose labels are the target's own, block [anchor token,
   MASK × (B − 1)], loss weights exp(−(k − 1)/γ)); block sizes cycle through `--blocks` (serving
   verifies `num_draft_tokens` ≤ B positions: 4 on the CPU config). Each `--layers` value is a
   draft trained on the same batches (a deeper one gets extra layers whose output projections
   start at zero, so every draft starts as `--init-draft`'s function).
3. Held-out: greedy continuations of held-out-file prompts of `--held-prompt` tokens. Two numbers:
   "accepted", the mean matching prefix of the draft's block against the target's tokens over
   random anchors (teacher-forced; every position counts once), and τ, the decode loop replayed
   on these sequences: from the first generated token, the draft proposes a block at the last
   committed position, the matching prefix plus the target's token are committed, and the next
   block starts there, for `--held-new` tokens. The continuation is the target's greedy output, so
   this is the τ the server's greedy loop gets, up to feature rounding (bf16 features here,
   float32 in serving); tools/eval_dflash.py measures it through the real scheduler. (The
   anchors, the growing of a deeper draft and both numbers: glm53/support/draft_distill.py.)

Deterministic seeds; the generation rounds and draft steps follow the time budgets (printed), and
`--gen-rounds/--draft-steps` set to the printed counts repeat the run.

DSpark heads (`--dspark-rank R`): `--init-draft` stays frozen and only DSpark's Markov head (rank
R) and confidence head are trained on the same generated data (glm53/support/dspark_heads.py);
OUT/dspark is the draft plus the heads. Held-out τ is the replayed greedy loop with the DSpark
chain, beside the frozen DFlash draft's on the same sequences, per block size, and with the
confidence cut at a few thresholds (τ and the drafts verified per step).
With `--dspark-joint` the heads are instead trained together with a body beside the DFlash drafts,
on the same batches for the same steps (body and heads started from `--init-dspark`, or the body
from `--init-draft` and fresh heads of `--dspark-rank`): OUT/dspark is that body plus its heads,
and the held-out tables give its DSpark τ beside the DFlash drafts' τ.

`--held-package NAME ...`: held-out τ also on prompts from the middle of those installed
packages' source files (third-party code; build the corpus without them, tools/build_corpus.py).
`--seed`: the training prompts (a different seed gives new data for a draft already trained).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from glm53.support.corpus import corpus_streams, held_file_prompts, package_prompts
from glm53.support.distill_data import Data, build, label_agreement
from glm53.support.draft_distill import draft_feats, held_accept, init_from, replay_tau, sample_anchors
from glm53.support.draft_trainer import DRAFT_DIMS, DraftTrainer, draft_config, draft_loss, save_draft
from glm53.support.dspark_heads import (DSparkHeads, block_hidden, heads_loss, load_heads, replay_tau_dspark,
                                        save_dspark)
from glm53.support.training import StepBudget, log, lr_at

KINDS = ("greedy", "sampled head", "greedy", "sampled head", "sampled")
PROMPT_LENS = (32, 64, 128, 200, 256)


def evaluate(drafts, heads, helds: dict, w, a, device, blocks, tag: str, final: bool = False) -> dict:
    """Held-out numbers per draft and block size on `helds` (name -> Data; "held" = the corpus's
    held-out split, others = third-party packages, `--held-package`): loss, accepted and τ for a
    DFlash draft, τ of the DSpark chain for a joint DSpark draft (`heads`)."""
    res = {}
    for name, d in drafts.items():
        for B in blocks:
            for hname, held in helds.items():
                key = f"{name}_B{B}" + ("" if hname == "held" else f"_{hname}")
                if name in heads:
                    res[key] = {"tau": round(replay_tau_dspark(d, heads[name], held, w, device, B, a.held_new)[0], 3)}
                    continue
                tau = replay_tau(d, held, w, device, B, a.held_new)
                if hname != "held":
                    res[key] = {"tau": round(tau, 3)}
                    continue
                hl, ha = held_accept(d, held, w, a, device, B)
                res[key] = {"held_loss": round(hl, 4), "accepted": round(ha, 3), "tau": round(tau, 3)}
                if final:  # the prompts tools/eval_dflash.py decodes at batch 16 (and one at a time)
                    res[key]["tau_eval16"] = round(replay_tau(d, held.head(16), w, device, B, a.held_new), 3)
    log(f"{tag}: " + "  ".join(f"{k} " + " ".join(f"{m} {v:g}" for m, v in r.items()) for k, r in res.items()))
    return res


def train(drafts: dict, heads: dict, data: Data, helds: dict, w, a, device, save) -> None:
    """Every draft on the same batches; a DSpark draft (`heads[name]`) by the Markov CE plus the
    confidence BCE through its body and heads (glm53/support/dspark_heads.py, joint)."""
    def params(name):
        return [*drafts[name].parameters(), *(heads[name].parameters() if name in heads else ())]

    opts = {L: torch.optim.AdamW(params(L), lr=a.draft_lr, betas=(0.9, 0.95), weight_decay=0.01,
                                 fused=device.type == "cuda") for L in drafts}
    g = torch.Generator(device=device).manual_seed(2)
    starts = data.starts.to(device)
    S = data.tokens.shape[1]
    full_b = a.block_size
    budget = StepBudget(a.draft_steps, a.draft_seconds, "draft")
    step, marks = 0, set()
    while step < budget.total:
        budget.tick(step)
        if step == 41 and not a.draft_steps:
            marks = {budget.total // 3, 2 * budget.total // 3}
        lr = lr_at(step, budget.total, a.draft_lr, 30)
        idx = torch.randint(0, data.m, (a.batch,), generator=g, device=device)
        x, f = data.tokens[idx], draft_feats(data.feats[idx], device)
        B = a.blocks[step % len(a.blocks)]
        anchors = sample_anchors(starts[idx], a.anchors, S, B, g)
        msg = []
        for L, d in drafts.items():
            for grp in opts[L].param_groups:
                grp["lr"] = lr
            d.B = B
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                if L in heads:
                    ce, bce, acc = heads_loss(heads[L], d(x, f, anchors, w[0], None), w[1], x, anchors, B,
                                              train_body=True)
                    loss = ce + bce
                else:
                    loss, acc = draft_loss(d(x, f, anchors, *w), x, anchors, B)
            d.B = full_b
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params(L), 1.0)
            opts[L].step()
            opts[L].zero_grad(set_to_none=True)
            if step % 100 == 0 or step == budget.total - 1:
                msg.append(f"{L} loss {loss.item():.3f} acc {acc.item():.2f}")
        if msg:
            log(f"draft step {step:5d} (block {B:2d}) " + "  ".join(msg) + f" {budget.elapsed():.0f}s")
        if step in marks:
            evaluate(drafts, heads, helds, w, a, device, (full_b,), f"held-out at step {step}")
            save(drafts)  # a run cut short still leaves a draft
        step += 1
    log(f"draft: {step} steps in {budget.elapsed():.0f}s")


def distill_heads(a, device, data: Data, held: Data, w) -> None:
    """--dspark-rank: train DSpark's heads on the frozen --init-draft (module doc)."""
    dcfg = json.loads((a.init_draft / "config.json").read_text())
    draft = DraftTrainer({**dcfg, "block_size": a.block_size})
    init_from(draft, a.init_draft)
    draft.to(device).requires_grad_(False)
    heads = DSparkHeads(dcfg["vocab_size"], dcfg["hidden_size"], a.dspark_rank).to(device)
    opt = torch.optim.AdamW(heads.parameters(), lr=a.draft_lr, betas=(0.9, 0.95), weight_decay=a.heads_wd)
    g = torch.Generator(device=device).manual_seed(3)
    starts, S, B = data.starts.to(device), data.tokens.shape[1], a.block_size
    budget = StepBudget(a.draft_steps, a.draft_seconds, "heads")

    def report(tag: str, thresholds=(0.0,)) -> dict:
        res = {}
        for b in sorted({4, 8, B}):
            base, _ = replay_tau_dspark(draft, None, held, w, device, b, a.held_new)
            row = {"dflash_tau": round(base, 3)}
            for t in thresholds:
                tau, per = replay_tau_dspark(draft, heads, held, w, device, b, a.held_new, threshold=t)
                row[f"dspark_tau@{t}"], row[f"drafts_per_step@{t}"] = round(tau, 3), round(per, 2)
            res[f"B{b}"] = row
        log(f"{tag}: " + json.dumps(res))
        return res

    # The draft is frozen: its block hidden at `--anchors` fixed anchors per sequence is computed
    # once (bf16), and the heads' steps read it (a step is then the heads alone, not a draft forward).
    t1 = time.time()
    all_anchors = sample_anchors(starts[: data.m], a.anchors, S, B, g)
    hidden = torch.empty(data.m, a.anchors, B - 1, dcfg["hidden_size"], dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for s0 in range(0, data.m, a.batch):
            sl = slice(s0, min(s0 + a.batch, data.m))
            hidden[sl] = block_hidden(draft, data.tokens[sl], draft_feats(data.feats[sl], device), all_anchors[sl],
                                      w[0]).to(torch.bfloat16)
    log(f"frozen draft's block hidden: {data.m} sequences x {a.anchors} anchors in {time.time() - t1:.0f}s")
    step = 0
    while step < budget.total:
        budget.tick(step)
        lr = lr_at(step, budget.total, a.draft_lr, 30)
        for grp in opt.param_groups:
            grp["lr"] = lr
        idx = torch.randint(0, data.m, (a.heads_batch,), generator=g, device=device)
        x, anchors, h = data.tokens[idx], all_anchors[idx], hidden[idx].float()
        ce, bce, acc = heads_loss(heads, h, w[1], x, anchors, B)
        (ce + bce).backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 200 == 0 or step == budget.total - 1:
            log(f"heads step {step:5d} markov ce {ce.item():.3f} confidence bce {bce.item():.3f} "
                f"accepted {acc.item():.2f} {budget.elapsed():.0f}s")
        step += 1
    log(f"heads: {step} steps in {budget.elapsed():.0f}s")
    save_dspark(a.init_draft, heads, a.out / "dspark")
    log("results " + json.dumps(report("held-out after", (0.0, 0.1, 0.2, 0.3))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--init-draft", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT/draft-L<layers> per --layers value")
    ap.add_argument("--layers", type=int, nargs="+", default=[3])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 8, 16, 4], help="training block sizes, cycled")
    ap.add_argument("--seq", type=int, default=448, help="tokens per generated sequence (prompt + continuation)")
    ap.add_argument("--gen-batch", type=int, default=8192, help="sequences per generation round")
    ap.add_argument("--gen-seconds", type=float, default=120)
    ap.add_argument("--gen-rounds", type=int, default=0)
    ap.add_argument("--max-rounds", type=int, default=8, help="capacity of the data buffer, in rounds")
    ap.add_argument("--held-batch", type=int, default=512)
    ap.add_argument("--held-prompt", type=int, default=200)
    ap.add_argument("--held-new", type=int, default=128)
    ap.add_argument("--check-dtypes", action="store_true", help="measure how often bf16 would change greedy labels")
    ap.add_argument("--draft-seconds", type=float, default=150)
    ap.add_argument("--draft-steps", type=int, default=0)
    ap.add_argument("--draft-lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--anchors", type=int, default=48)
    ap.add_argument("--corpus", type=Path, help="a Python standard library source tree (default: this Python's)")
    ap.add_argument("--dspark-rank", type=int, default=0,
                    help="train DSpark's Markov (this rank) and confidence heads on the frozen --init-draft")
    ap.add_argument("--heads-batch", type=int, default=32, help="sequences per heads step (all their anchors)")
    ap.add_argument("--heads-wd", type=float, default=0.01)
    ap.add_argument("--dspark-joint", action="store_true",
                    help="beside the DFlash drafts, train a DSpark draft (body and heads together) on the same batches")
    ap.add_argument("--init-dspark", type=Path, help="--dspark-joint: start the body and heads from this DSpark checkpoint's"
                    " (with a --dspark-rank above its own, the Markov head widened to it, same function)")
    ap.add_argument("--seed", type=int, default=10, help="the training data's prompts and sampling")
    ap.add_argument("--held-package", nargs="*", default=[],
                    help="also report held-out τ on prompts from these installed packages (third-party code)")
    ap.add_argument("--held-package-prompts", type=int, default=64)
    a = ap.parse_args()
    if a.dspark_rank and a.init_draft is None and not a.dspark_joint:
        raise SystemExit("--dspark-rank trains heads on a frozen draft: give it with --init-draft")
    if a.dspark_joint and not (a.dspark_rank or a.init_dspark):
        raise SystemExit("--dspark-joint needs the heads' rank (--dspark-rank) or heads to start from (--init-dspark)")
    if a.corpus:
        os.environ["GLM53_CORPUS"] = str(a.corpus)
    if a.block_size not in a.blocks or max(a.blocks) > a.block_size:
        raise SystemExit(f"--blocks {a.blocks} must include --block-size {a.block_size} and not exceed it")
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # generation in fp32 as served
    t0 = time.time()
    from glm53.models import ModelRunner

    frozen_heads = a.dspark_rank and not a.dspark_joint
    dcfg = json.loads((a.init_draft / "config.json").read_text()) if frozen_heads else draft_config(a.target)
    ids = dcfg["dflash_config"]["target_layer_ids"]
    width = len(ids) * dcfg["hidden_size"]
    train_s, held_s = corpus_streams(a.target)
    log(f"corpus: {len(train_s)} held-in tokens, {len(held_s)} held-out tokens, {time.time() - t0:.0f}s")
    pages = max(a.gen_batch, a.held_batch) * -(-a.seq // 16)
    runner = ModelRunner.from_dir(a.target, page_size=16, num_pages=pages, device=str(device), dtype=torch.float32,
                                  progress=False)
    held = Data.empty(a.held_batch, a.seq, width, device)
    files = held_file_prompts(a.target, a.held_batch, a.held_prompt)
    build(runner, held_s, held, n=a.held_batch, seconds=0, rounds=1, seed=11, kinds=("greedy",),
          lens=(a.held_prompt,), layer_ids=ids, first=files)
    log(f"held-out: {len(files)} file-start prompts (tools/eval_dflash.py's), {a.held_batch - len(files)} random windows")
    helds = {"held": held}
    for pkg in a.held_package:
        prompts = package_prompts(a.target, pkg, a.held_package_prompts, a.held_prompt, strict=False)
        helds[pkg] = Data.empty(len(prompts), a.seq, width, device)
        build(runner, held_s, helds[pkg], n=len(prompts), seconds=0, rounds=1, seed=11, kinds=("greedy",),
              lens=(a.held_prompt,), layer_ids=ids, first=prompts)
        log(f"held-out {pkg}: {len(prompts)} prompts from the middle of its source files")
    lens = [n for n in PROMPT_LENS if n + 24 + max(a.blocks) + a.anchors <= a.seq] or [a.seq // 4]
    data = Data.empty(a.max_rounds * a.gen_batch, a.seq, width, device)
    build(runner, train_s, data, n=a.gen_batch, seconds=a.gen_seconds, rounds=a.gen_rounds, seed=a.seed, kinds=KINDS,
          lens=lens, layer_ids=ids)
    data = data.view()
    w = (runner.model.model.embed_tokens.weight.detach().clone(), runner.model.lm_head.weight.detach().clone())
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if a.check_dtypes:
        for dt in (torch.float32, torch.bfloat16):
            log(f"greedy labels an {dt} target also takes as its argmax (teacher-forced, held-out): "
                f"{label_agreement(a.target, held, dt, device):.4%}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = True
    if frozen_heads:
        distill_heads(a, device, data, held, w)
        log(f"total {time.time() - t0:.0f}s")
        return
    assert dcfg["intermediate_size"] == DRAFT_DIMS["intermediate_size"]
    drafts, cfgs, heads = {}, {}, {}
    for L in a.layers:
        cfgs[f"L{L}"] = {**dcfg, "num_hidden_layers": L, "block_size": a.block_size}
    if a.dspark_joint:  # a body like the first DFlash draft's, trained with its heads
        cfgs["dspark"] = cfgs[f"L{a.layers[0]}"]
        heads["dspark"] = (load_heads(a.init_dspark, a.dspark_rank) if a.init_dspark else
                           DSparkHeads(dcfg["vocab_size"], dcfg["hidden_size"], a.dspark_rank)).to(device)
    for name, cfg in cfgs.items():
        torch.manual_seed(7)
        drafts[name] = DraftTrainer(cfg)
        # A DSpark checkpoint carries its own body (trained with its heads): continue from it.
        init_from(drafts[name], a.init_dspark if name in heads and a.init_dspark else a.init_draft)
        drafts[name].to(device)
        log(f"draft {name}: {cfg['num_hidden_layers']} layers, block {a.block_size}, "
            f"{sum(p.numel() for p in drafts[name].parameters()) / 1e6:.2f}M params, target_layer_ids {ids}"
            + (f", DSpark heads of rank {heads[name].markov_head.markov_w1.weight.shape[1]}" if name in heads else ""))
    log(f"training: batch {a.batch} sequences x {a.anchors} anchors, blocks {a.blocks}, lr {a.draft_lr}")
    evaluate(drafts, heads, helds, w, a, device, (4, a.block_size), "held-out before")

    def save(ds):
        for name, d in ds.items():
            save_draft(d, cfgs[name], a.out / name.replace("L", "draft-L"))
            if name in heads:
                save_dspark(a.out / name, heads[name], a.out / name)

    train(drafts, heads, data, helds, w, a, device, save)
    save(drafts)
    res = evaluate(drafts, heads, helds, w, a, device, sorted({4, 8, a.block_size}), "held-out after", final=True)
    log("results " + json.dumps(res))
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

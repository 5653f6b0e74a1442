"""Train a tiny MTP (NextN) layer for the embedded target: the target stays frozen, only the layer
learns, on the target's own greedy continuations (the held-in standard-library windows
tools/distill_draft.py generates from, glm53/support/distill_data.py).

    PYTHONPATH=. python tools/train_mtp.py --target assets/tiny-glm5 --out OUT [--gen-seconds 150]
        [--train-seconds 420] [--install]

Data: sequences [prompt, greedy continuation] and random corpus windows run through the target
teacher-forced (`--window-seconds`: far more rows per second than decoding), each with the
target's final-normed last hidden state h at every position (the capture of the last layer).
The layer at position j reads (t_{j+1}, h_j) and learns what the target says after t_{j+1}, the
argmax of lm_head(h_{j+1}) (= t_{j+2} in a greedy continuation) (cross-entropy through the
target's lm_head); chained steps as served (`--step-weights`): step k reads the layer's own
output h' of step k − 1 at j − 1 in place of h_j, for the same label. Init: the decoder layer (attention, its DSA indexer, MoE, norms) copied
from the target's last layer, eh_proj reading h through the identity and the embedding through
small random weights. The forward is glm53/support/mtp_trainer.py's (serving formulas, DSA as
the serving indexer selects). Held-out: τ of the served decode loop (ModelRunner.spec_step, 3
steps, greedy) on third-party code (`--package`, tools/eval_dflash.py's prompts).

OUT is a copy of the target checkpoint plus the layer (num_nextn_predict_layers: 1); the
target's tensors are copied unchanged (checked). `--install` writes it over --target.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from glm53.models import DraftBlock, GlmConfig, ModelRunner, SeqChunk
from glm53.models.kv_cache import KVPools
from glm53.support.corpus import corpus_streams, package_prompts
from glm53.support.distill_data import Data, build
from glm53.support.mtp_checkpoint import random_nextn, write_mtp_layer
from glm53.support.mtp_trainer import train_rows
from glm53.support.training import log


def init_layer(draft, target, seed: int) -> None:
    """The decoder layer from the target's last layer; eh_proj = [small random | identity]."""
    cfg = draft.cfg
    last = f"model.layers.{cfg.num_hidden_layers - 1}."
    src = dict(target.named_parameters())
    H = cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            key = last + name.split(".", 3)[3]
            if key in src and src[key].shape == p.shape:
                p.copy_(src[key])
        w = draft.layer.eh_proj.weight
        w[:, :H] = torch.randn(H, H, generator=g) * 0.02
        w[:, H:] = torch.eye(H)


@torch.no_grad()
def corpus_windows(runner, stream: torch.Tensor, seq: int, seconds: float, batch: int, seed: int) -> Data:
    """Random `seq`-token windows of the corpus, each run through the target once (teacher-forced,
    no decoding): tokens and the final-normed hidden state of every position. Labels come from
    the hidden states themselves (the target's own argmax), so these rows teach what the target
    would say next after a corpus token: many more rows per second than decoding gives."""
    cfg, ps = runner.cfg, runner.page_size
    npg = -(-seq // ps)
    g = torch.Generator().manual_seed(seed)
    toks, feats = [], []
    t0 = time.time()
    while time.time() - t0 < seconds:
        at = torch.randint(0, len(stream) - seq, (batch,), generator=g).tolist()
        w = torch.stack([stream[s: s + seq] for s in at])
        chunks = [SeqChunk(w[i].tolist(), 0, list(range(i * npg, (i + 1) * npg))) for i in range(batch)]
        b, _ = runner.build_batch(chunks)
        out = runner.model.forward_stage(b, runner.pools, None, capture=[cfg.num_hidden_layers - 1])
        toks.append(w)
        feats.append(out.captures[cfg.num_hidden_layers - 1].view(batch, seq, -1).to(torch.bfloat16))
    m = batch * len(toks)
    log(f"corpus windows: {m} of {seq} tokens teacher-forced in {time.time() - t0:.0f}s")
    return Data(torch.cat(toks), torch.cat(feats), torch.zeros(m, dtype=torch.long), torch.zeros(m, dtype=torch.bool),
                torch.ones(m, dtype=torch.long), m)


def tau(model_dir: Path, prompts: list[list[int]], new: int, steps: int) -> float:
    """Tokens committed per verify of the served greedy loop (first, undrafted step excluded)."""
    r = ModelRunner.from_dir(model_dir, page_size=16, num_pages=len(prompts) * 32, progress=False,
                             nextn_steps=steps)
    pages = [list(range(32 * i, 32 * i + 32)) for i in range(len(prompts))]
    outs = [[int(lg[-1].argmax())] for lg in r.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)])]
    committed = verifies = 0
    first = True
    while any(len(o) < new for o in outs):
        idx = [i for i, o in enumerate(outs) if len(o) < new]
        blocks = [DraftBlock(outs[i][-1], len(prompts[i]) + len(outs[i]) - 1, pages[i],
                             block_size=min(steps + 1, new - len(outs[i])), key=i) for i in idx]
        res = r.spec_step(blocks)
        for j, i in enumerate(idx):
            d, am = res.drafts[j], res.greedy[j]
            a = 0
            while a < len(d) and d[a] == am[a]:
                a += 1
            toks = (d[:a] + [am[a]])[: new - len(outs[i])]
            outs[i].extend(toks)
            if not first:
                committed, verifies = committed + len(toks), verifies + 1
        first = False
    return committed / max(1, verifies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("assets/tiny-glm5"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--gen-batch", type=int, default=96)
    ap.add_argument("--gen-seconds", type=float, default=150)
    ap.add_argument("--max-rounds", type=int, default=8, help="generation rounds the data buffer holds")
    ap.add_argument("--data", type=Path, help="reuse (or save) the generated sequences here")
    ap.add_argument("--window-seconds", type=float, default=120,
                    help="teacher-forced corpus windows added to the data, generated for this long")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--train-seconds", type=float, default=420)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--package", default="httpx")
    ap.add_argument("--held-prompts", type=int, default=8)
    ap.add_argument("--held-prompt", type=int, default=128)
    ap.add_argument("--held-new", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--step-weights", type=float, nargs="+", default=[1.0, 0.7, 0.5],
                    help="loss weight of each chained step trained (step 1 reads the target's hidden)")
    ap.add_argument("--init", type=Path, help="start from this checkpoint's MTP layer (an earlier --out)")
    ap.add_argument("--install", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    cfg = GlmConfig.from_dir(a.target)
    H, ps = cfg.hidden_size, 16
    runner = ModelRunner.from_dir(a.target, page_size=ps, num_pages=a.gen_batch * -(-a.seq // ps), progress=False,
                                  dtype=torch.float32)
    if a.data is not None and a.data.is_file():  # an earlier run's sequences (same target, same --seq)
        d = torch.load(a.data)
        data = Data(d["tokens"], d["feats"], d["starts"], d["greedy"], d["plen"], len(d["tokens"]))
    else:
        train_s, _ = corpus_streams(a.target)
        data = Data.empty(a.max_rounds * a.gen_batch, a.seq, H, "cpu")
        build(runner, train_s, data, n=a.gen_batch, seconds=a.gen_seconds, rounds=0, seed=10, kinds=("greedy",),
              lens=[32, 64, 96], layer_ids=[cfg.num_hidden_layers - 1])
        data = data.view()
        if a.window_seconds > 0:
            win = corpus_windows(runner, train_s, a.seq, a.window_seconds, a.gen_batch, seed=12)
            data = Data(*(torch.cat([getattr(data, k), getattr(win, k)])
                          for k in ("tokens", "feats", "starts", "greedy", "plen")), data.m + win.m)
        if a.data is not None:
            torch.save({k: getattr(data, k) for k in ("tokens", "feats", "starts", "greedy", "plen")}, a.data)
    log(f"data: {data.m} sequences of {a.seq}, {time.time() - t0:.0f}s")

    draft = random_nextn(cfg, seed=1)
    if a.init is not None:  # continue from an earlier run's layer (its checkpoint directory)
        from glm53.models.mtp_weights import load_nextn_weights

        load_nextn_weights(draft, a.init)
        log(f"init: the MTP layer of {a.init}")
    else:
        init_layer(draft, runner.model, seed=2)
    draft.bind(runner.model.model.embed_tokens, runner.model.lm_head)
    npg = -(-a.seq // ps)
    draft.add_pools(KVPools(a.batch * npg, ps))
    params = [p for n, p in draft.named_parameters() if ".indexer." not in n]
    for p in draft.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay)
    g = torch.Generator().manual_seed(3)
    S = a.seq - 1  # rows j = 0..S-1 read t_{j+1}; labels t_{j+2} exist for j <= S - 2
    chunks = [SeqChunk([0] * S, 0, list(range(b * npg, (b + 1) * npg))) for b in range(a.batch)]
    batch, _ = runner.build_batch(chunks)
    j = torch.arange(S)
    step, t1, ema = 0, time.time(), None
    while time.time() - t1 < a.train_seconds:
        idx = torch.randint(0, data.m, (a.batch,), generator=g)
        toks = data.tokens[idx]
        feats = data.feats[idx, :S].float().reshape(-1, H)
        nxt = toks[:, 1:S + 1].reshape(-1)
        # Row j's label: what the target says after t_{j+1}, the argmax of its hidden at j + 1 (in
        # a greedy continuation that is t_{j+2} itself).
        with torch.no_grad():
            lab = runner.model.lm_head(data.feats[idx, 1:].float()).argmax(-1)
        lab = torch.cat([lab, torch.zeros(a.batch, 1, dtype=torch.long)], 1)[:, :S]
        keep = (j[None] <= S - 2).expand(a.batch, S).reshape(-1)
        batch.input_ids = nxt
        # Chained steps as served: step k's row j reads (t_{j+1}, h'_{j-1} of step k − 1) and
        # learns the same t_{j+2}; step 1 reads the target's h_j.
        hidden, loss = feats, 0.0
        for k, wk in enumerate(a.step_weights):
            hn = train_rows(draft, nxt, hidden, batch, S)
            logits = runner.model.lm_head(hn[keep]).float()
            loss = loss + wk * torch.nn.functional.cross_entropy(logits, lab.reshape(-1)[keep])
            if k == 0:
                first_logits = logits
            hn = hn.view(a.batch, S, H)
            hidden = torch.cat([feats.view(a.batch, S, H)[:, :1], hn[:, :-1]], 1).reshape(-1, H)
        logits = first_logits
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        acc = (logits.argmax(-1) == lab.reshape(-1)[keep]).float().mean().item()
        ema = acc if ema is None else 0.98 * ema + 0.02 * acc
        if step % 25 == 0:
            log(f"step {step}: loss {loss.item():.3f}, next-next accuracy (ema) {ema:.3f}, {time.time() - t1:.0f}s")
    log(f"trained {step} steps of {a.batch} x {S} rows in {time.time() - t1:.0f}s (lr {a.lr}, chained-step "
        f"weights {a.step_weights})")

    a.out.mkdir(parents=True, exist_ok=True)
    for f in a.target.iterdir():
        if f.is_file():
            shutil.copy2(f, a.out / f.name)
    write_mtp_layer(a.out, draft.to(torch.float32))
    before, after = load_file(str(a.target / "model.safetensors")), load_file(str(a.out / "model.safetensors"))
    same = all(torch.equal(before[k], after[k]) for k in before if not k.startswith(f"model.layers.{cfg.num_hidden_layers}."))
    digest = hashlib.sha256(b"".join(before[k].contiguous().view(torch.uint8).numpy().tobytes()
                                     for k in sorted(before) if not k.startswith(f"model.layers.{cfg.num_hidden_layers}."))).hexdigest()
    log(f"target tensors unchanged: {same} (sha256 of the target's tensors in name order {digest[:16]})")
    if not same:
        raise SystemExit("the target's tensors changed")
    prompts = package_prompts(a.target, a.package, a.held_prompts, a.held_prompt)
    t = tau(a.out, prompts, a.held_new, a.steps)
    log(f"held-out tau ({a.package}: {len(prompts)} prompts of {a.held_prompt} tokens, {a.held_new} new, "
        f"{a.steps} steps, greedy, served spec_step): {t:.2f}")
    if a.install:
        for name in ("model.safetensors", "config.json"):
            shutil.copy2(a.out / name, a.target / name)
        log(f"installed into {a.target}")


if __name__ == "__main__":
    main()

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

`--device cuda`: the target runner, the data and the training on the GPU (fp32, as on the CPU;
data generated in larger batches). `--layer-out FILE`: also write the layer's tensors alone
(model.layers.6.*, the checkpoint's names and dtypes, ~3 MB). `--install-layer FILE`: no
training; such a file merged into a copy of --target in OUT (the target's tensors checked
byte-identical), τ measured, then installed over --target (`--layer-in FILE`: the same, not
installed). Labels (the target's argmax at every position) are computed once with the data.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glm53.models import GlmConfig, ModelRunner, SeqChunk
from glm53.models.kv_cache import KVPools
from glm53.support.corpus import corpus_streams, package_prompts
from glm53.support.distill_data import Data, build
from glm53.support.greedy import spec_greedy
from glm53.support.mtp_checkpoint import layer_tensors, random_nextn, write_layer_tensors
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
def corpus_windows(runner, stream: torch.Tensor, seq: int, seconds: float, batch: int, seed: int,
                   cap: int | None = None) -> Data:
    """Random `seq`-token windows of the corpus, each run through the target once (teacher-forced,
    no decoding): tokens and the final-normed hidden state of every position. Labels come from
    the hidden states themselves (the target's own argmax), so these rows teach what the target
    would say next after a corpus token: many more rows per second than decoding gives."""
    cfg, ps = runner.cfg, runner.page_size
    npg = -(-seq // ps)
    g = torch.Generator().manual_seed(seed)
    toks, feats = [], []
    t0 = time.time()
    while time.time() - t0 < seconds and (cap is None or batch * len(toks) < cap):
        at = torch.randint(0, len(stream) - seq, (batch,), generator=g).tolist()
        w = torch.stack([stream[s: s + seq] for s in at]).to(runner.device)
        chunks = [SeqChunk(w[i].tolist(), 0, list(range(i * npg, (i + 1) * npg))) for i in range(batch)]
        b, _ = runner.build_batch(chunks)
        out = runner.model.forward_stage(b, runner.pools, None, capture=[cfg.num_hidden_layers - 1])
        toks.append(w)
        feats.append(out.captures[cfg.num_hidden_layers - 1].view(batch, seq, -1).to(torch.bfloat16))
    m = batch * len(toks)
    log(f"corpus windows: {m} of {seq} tokens teacher-forced in {time.time() - t0:.0f}s")
    return Data(torch.cat(toks), torch.cat(feats), torch.zeros(m, dtype=torch.long), torch.zeros(m, dtype=torch.bool),
                torch.ones(m, dtype=torch.long), m)


def tau(model_dir: Path, prompts: list[list[int]], new: int, steps: int, device: str = "cpu") -> float:
    """Tokens committed per verify of the served greedy loop (first, undrafted step excluded)."""
    r = ModelRunner.from_dir(model_dir, page_size=16, num_pages=len(prompts) * 32, progress=False,
                             nextn_steps=steps, device=device, dtype=torch.float32)
    pages = [list(range(32 * i, 32 * i + 32)) for i in range(len(prompts))]
    _, committed, verifies = spec_greedy(r, prompts, pages, new, steps + 1)
    return committed / max(1, verifies)


@torch.no_grad()
def target_labels(runner, feats: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """[M, S-1] the target's argmax after each position's successor: lm_head(h_{j+1}), computed once
    (the last column reads the zero feature of position S − 1 and is never a kept label)."""
    out = []
    for s in range(0, len(feats), chunk):
        out.append(runner.model.lm_head(feats[s: s + chunk, 1:].float()).argmax(-1))
    return torch.cat(out)


def check_and_tau(a, cfg, out_dir: Path) -> float:
    """The target's tensors in `out_dir` byte-identical to --target's (else exit); held-out τ."""
    L = f"model.layers.{cfg.num_hidden_layers}."
    before, after = load_file(str(a.target / "model.safetensors")), load_file(str(out_dir / "model.safetensors"))
    keys = sorted(k for k in before if not k.startswith(L))
    same = set(keys) == {k for k in after if not k.startswith(L)} and all(
        before[k].dtype == after[k].dtype and torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))
        for k in keys)
    digest = hashlib.sha256(b"".join(before[k].contiguous().view(torch.uint8).numpy().tobytes() for k in keys)).hexdigest()
    log(f"target tensors unchanged: {same} ({len(keys)} tensors, sha256 of the target's tensors in name order "
        f"{digest[:16]})")
    if not same:
        raise SystemExit("the target's tensors changed")
    try:
        prompts = package_prompts(a.target, a.package, a.held_prompts, a.held_prompt)
    except ValueError as e:  # e.g. a device machine without the package installed
        log(f"held-out tau not measured: {e}")
        return float("nan")
    t = tau(out_dir, prompts, a.held_new, a.steps, a.device)
    log(f"held-out tau ({a.package}: {len(prompts)} prompts of {a.held_prompt} tokens, {a.held_new} new, "
        f"{a.steps} steps, greedy, served spec_step, {a.device}): {t:.2f}")
    return t


def copy_target(a, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in a.target.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)


def install(a, out: Path) -> None:
    src = a.target / "model.safetensors"
    old = hashlib.sha256(src.read_bytes()).hexdigest()
    for name in ("model.safetensors", "config.json"):
        shutil.copy2(out / name, a.target / name)
    log(f"installed into {a.target} (sha256 of model.safetensors before {old[:8]}..., after "
        f"{hashlib.sha256(src.read_bytes()).hexdigest()[:8]}...)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("assets/tiny-glm5"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the VM has 2 cores)")
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--gen-batch", type=int, help="sequences a generation round (default 96, cuda 512)")
    ap.add_argument("--gen-seconds", type=float, default=150)
    ap.add_argument("--max-rounds", type=int, default=8, help="generation rounds the data buffer holds")
    ap.add_argument("--data", type=Path, help="reuse (or save) the generated sequences here")
    ap.add_argument("--window-seconds", type=float, default=120,
                    help="teacher-forced corpus windows added to the data, generated for this long")
    ap.add_argument("--max-windows", type=int, help="at most this many corpus windows (memory: 80 KB each)")
    ap.add_argument("--window-batch", type=int, help="windows a target forward (default --gen-batch)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--train-seconds", type=float, default=420)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    ap.add_argument("--cosine", action="store_true", help="cosine lr decay to 10 %% over --train-seconds")
    ap.add_argument("--package", default="httpx")
    ap.add_argument("--held-prompts", type=int, default=8)
    ap.add_argument("--held-prompt", type=int, default=128)
    ap.add_argument("--held-new", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--step-weights", type=float, nargs="+", default=[1.0, 0.7, 0.5],
                    help="loss weight of each chained step trained (step 1 reads the target's hidden)")
    ap.add_argument("--init", type=Path, help="start from this checkpoint's MTP layer (an earlier --out)")
    ap.add_argument("--layer-out", type=Path, help="also write the layer's tensors alone to this safetensors file")
    ap.add_argument("--layer-in", type=Path, help="no training: this --layer-out file's layer, checked and measured")
    ap.add_argument("--install-layer", type=Path, help="--layer-in FILE --install")
    ap.add_argument("--install", action="store_true")
    a = ap.parse_args()
    if a.install_layer is not None:
        a.layer_in, a.install = a.install_layer, True
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    if a.gen_batch is None:
        a.gen_batch = 512 if dev.type == "cuda" else 96
    t0 = time.time()
    cfg = GlmConfig.from_dir(a.target)
    H, ps = cfg.hidden_size, 16
    prefix = f"model.layers.{cfg.num_hidden_layers}."

    if a.layer_in is not None:  # merge a trained layer file, check, measure, maybe install
        from safetensors import safe_open

        tensors = load_file(str(a.layer_in))
        with safe_open(str(a.layer_in), "pt") as f:
            meta = f.metadata() or {}
        log(f"layer file {a.layer_in}: {len(tensors)} tensors, {a.layer_in.stat().st_size / 1e6:.2f} MB, {meta}")
        like = load_file(str(a.target / "model.safetensors"))
        mine = {k: v for k, v in like.items() if k.startswith(prefix)}
        if mine and (set(mine) != set(tensors) or any(mine[k].dtype != tensors[k].dtype or mine[k].shape != tensors[k].shape
                                                       for k in mine)):
            raise SystemExit("the layer file's names, dtypes or shapes differ from the checkpoint's MTP layer")
        copy_target(a, a.out)
        write_layer_tensors(a.out, cfg.num_hidden_layers, tensors)
        check_and_tau(a, cfg, a.out)
        if a.install:
            install(a, a.out)
        return

    wb = a.window_batch or a.gen_batch
    runner = ModelRunner.from_dir(a.target, page_size=ps, num_pages=max(a.gen_batch, wb) * -(-a.seq // ps),
                                  progress=False, dtype=torch.float32, device=a.device)
    if a.data is not None and a.data.is_file():  # an earlier run's sequences (same target, same --seq)
        d = torch.load(a.data)
        data = Data(d["tokens"], d["feats"], d["starts"], d["greedy"], d["plen"], len(d["tokens"]))
        labels = d.get("labels")
    else:
        train_s, _ = corpus_streams(a.target)
        data = Data.empty(a.max_rounds * a.gen_batch, a.seq, H, dev)
        if a.gen_seconds > 0:
            build(runner, train_s, data, n=a.gen_batch, seconds=a.gen_seconds, rounds=0, seed=10, kinds=("greedy",),
                  lens=[32, 64, 96], layer_ids=[cfg.num_hidden_layers - 1])
        data = data.view()
        if a.window_seconds > 0:
            win = corpus_windows(runner, train_s, a.seq, a.window_seconds, wb, seed=12, cap=a.max_windows)
            data = Data(*(torch.cat([getattr(data, k).to(getattr(win, k).device), getattr(win, k)])
                          for k in ("tokens", "feats", "starts", "greedy", "plen")), data.m + win.m)
        labels = None
    data = Data(data.tokens.to(dev), data.feats.to(dev), data.starts, data.greedy, data.plen, data.m)
    if labels is None:
        t2 = time.time()
        labels = target_labels(runner, data.feats)
        log(f"labels: the target's argmax at {labels.numel()} positions in {time.time() - t2:.0f}s")
        if a.data is not None and not a.data.is_file():
            torch.save({k: getattr(data, k).cpu() for k in ("tokens", "feats", "starts", "greedy", "plen")}
                       | {"labels": labels.cpu()}, a.data)
    labels = labels.to(dev)
    log(f"data: {data.m} sequences of {a.seq}, {time.time() - t0:.0f}s")

    draft = random_nextn(cfg, seed=1)
    if a.init is not None:  # continue from an earlier run's layer (its checkpoint directory)
        from glm53.models.mtp_weights import load_nextn_weights

        load_nextn_weights(draft, a.init)
        log(f"init: the MTP layer of {a.init}")
    else:
        init_layer(draft, runner.model, seed=2)
    draft.to(dev)
    draft.init_buffers(dev)
    draft.bind(runner.model.model.embed_tokens, runner.model.lm_head)
    npg = -(-a.seq // ps)
    draft.add_pools(KVPools(a.batch * npg, ps, dev))
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
    j = torch.arange(S, device=dev)
    keep = (j[None] <= S - 2).expand(a.batch, S).reshape(-1)
    step, t1, ema = 0, time.time(), None
    while time.time() - t1 < a.train_seconds:
        frac = (time.time() - t1) / a.train_seconds
        lr = a.lr * min(1.0, (step + 1) / a.warmup if a.warmup else 1.0)
        if a.cosine:
            lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        for pg in opt.param_groups:
            pg["lr"] = lr
        idx = torch.randint(0, data.m, (a.batch,), generator=g).to(dev)
        toks = data.tokens[idx]
        feats = data.feats[idx, :S].float().reshape(-1, H)
        nxt = toks[:, 1:S + 1].reshape(-1)
        # Row j's label: what the target says after t_{j+1}, the argmax of its hidden at j + 1 (in
        # a greedy continuation that is t_{j+2} itself), computed once with the data.
        lab = labels[idx][:, :S].reshape(-1)[keep]
        batch.input_ids = nxt
        # Chained steps as served: step k's row j reads (t_{j+1}, h'_{j-1} of step k − 1) and
        # learns the same t_{j+2}; step 1 reads the target's h_j.
        hidden, loss = feats, 0.0
        for k, wk in enumerate(a.step_weights):
            hn = train_rows(draft, nxt, hidden, batch, S)
            logits = runner.model.lm_head(hn[keep]).float()
            loss = loss + wk * torch.nn.functional.cross_entropy(logits, lab)
            if k == 0:
                first_logits = logits
            hn = hn.view(a.batch, S, H)
            hidden = torch.cat([feats.view(a.batch, S, H)[:, :1], hn[:, :-1]], 1).reshape(-1, H)
        logits = first_logits
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 25 == 0 or dev.type == "cpu":
            acc = (logits.argmax(-1) == lab).float().mean().item()
            ema = acc if ema is None else (0.98 if dev.type == "cpu" else 0.6) * ema + (0.02 if dev.type == "cpu" else 0.4) * acc
        if step % (25 if dev.type == "cpu" else 250) == 0:
            log(f"step {step}: loss {loss.item():.3f}, next-next accuracy (ema) {ema:.3f}, lr {lr:.2e}, "
                f"{time.time() - t1:.0f}s")
    log(f"trained {step} steps of {a.batch} x {S} rows in {time.time() - t1:.0f}s (lr {a.lr}, chained-step "
        f"weights {a.step_weights}, {a.device})")

    draft = draft.to("cpu", torch.float32)
    copy_target(a, a.out)
    like = load_file(str(a.target / "model.safetensors"))
    tensors = layer_tensors(draft, like)
    write_layer_tensors(a.out, cfg.num_hidden_layers, tensors)
    if a.layer_out is not None:
        a.layer_out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(a.layer_out), metadata={"format": "pt", "steps": str(step), "device": a.device,
                                                       "data_rows": str(data.m), "lr": str(a.lr)})
        log(f"layer file {a.layer_out}: {len(tensors)} tensors, {a.layer_out.stat().st_size / 1e6:.2f} MB")
    check_and_tau(a, cfg, a.out)
    if a.install:
        install(a, a.out)


if __name__ == "__main__":
    main()

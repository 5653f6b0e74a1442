"""Train the embedded tiny GLM-5 (`glm_moe_dsa`) and its DFlash draft on Python source.

    PYTHONPATH=. python tools/train_tiny.py --out DIR [--target-seconds 270] [--draft-seconds 170]

Writes DIR/tiny-glm5 (Hugging Face layout: config.json, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja, model.safetensors in bf16, exactly the layout of
`glm53.server.embedded_model`) and DIR/tiny-glm5-dflash (the published DFlash layout:
`draft_config_dict` + model.safetensors), and prints the loss curves and held-out numbers.

Corpus: the running Python's standard library source (`*.py`, recursively); a file whose path
hashes (sha1 of its path relative to the stdlib) to < 5 % is held out. The tokenizer is the
byte-level BPE of `glm53.server.embedded_model` (same special tokens and chat template).

Target: transformers' `GlmMoeDsaForCausalLM`, training mode, bf16 autocast, AdamW. The DSA
indexer's forward is `@torch.no_grad` in transformers (top-k selection has no gradient), so it
would stay at its random init; this tool trains it with DeepSeek-V3.2's auxiliary KL loss
(dense warm-up form): on every "full" layer the indexer's softmax over causal keys is pulled
towards the main attention's distribution (summed over heads, detached), from detached inputs,
so the auxiliary loss trains only the indexer. Routing uses the aux-loss-free bias update
(e_score_correction_bias moves by ±1e-3 towards balanced expert load after every step).

Draft: a DFlash draft trained on the frozen target's own features (HF `hidden_states[id + 1]`),
the published recipe: random anchor positions, block [anchor token, MASK × (B − 1)] predicting
the next B − 1 tokens, loss weights exp(−(k − 1)/γ), γ = 7. `DraftTrainer.forward` mirrors
`glm53.models.draft.DFlashDraft` (KV injection of c = hidden_norm(fc(features)), k_norm + RoPE at
absolute positions, block non-causal, context strictly before the anchor, the target's
embedding and lm_head); `--check` verifies that on CPU against `DFlashDraft.propose`.

Deterministic seeds; the step counts follow the time budget (printed), so a rerun with
`--target-steps/--draft-steps` set to the printed counts repeats the same run (up to the GPU's
non-deterministic reductions). The shipped pair: `--target-steps 923 --draft-steps 1577` on
the Python 3.11.7 standard library (`--corpus`), benchmarks/RESULTS.md "The trained embedded pair".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from glm53.support.corpus import held_out, stdlib_files
from glm53.support.draft_trainer import DraftTrainer, draft_config, draft_loss, save_draft
from glm53.support.training import StepBudget, log, lr_at

# The shipped dimensions: ~20 MB of bf16 for target + draft + tokenizer.
TARGET_DIMS = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 160,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 96,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 64,
    "index_topk_freq": 2,
    "index_skip_topk_offset": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 8192,
}


# ---------------------------------------------------------------- corpus and tokenizer
# (the corpus files and their held-out split: glm53.support.corpus)

def write_target_files(out: Path):
    """Tokenizer, config and the other small files of the embedded layout (random weights are
    written too, then replaced by the trained ones). Returns (tokenizer, config dict)."""
    from glm53.server import embedded_model as em
    from tokenizers import Tokenizer

    em.MODEL_DIMS = dict(TARGET_DIMS)
    em.write_embedded_model(out)
    return Tokenizer.from_file(str(out / "tokenizer.json")), json.loads((out / "config.json").read_text())


def tokenize(tok, files: list[tuple[str, str]], eos: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch([t for _, t in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def batch_from(stream: torch.Tensor, n: int, seq: int, g: torch.Generator, device) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq - 1, (n,), generator=g)
    return torch.stack([stream[s : s + seq] for s in starts.tolist()]).long().to(device)


# ---------------------------------------------------------------- target

class IndexerAux:
    """DeepSeek-V3.2's indexer KL loss, from hooks on the attention modules with an indexer."""

    def __init__(self, model):
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

        self.rope = m.apply_rotary_pos_emb_interleave
        self.saved = []
        self.mods = [mod for mod in model.modules() if isinstance(mod, m.GlmMoeDsaAttention) and mod.indexer is not None]
        for mod in self.mods:
            mod.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.enabled = True

    def _hook(self, mod, args, kwargs):
        if self.enabled and mod.training:
            h = kwargs.get("hidden_states", args[0] if args else None)
            self.saved.append((mod, h, kwargs["position_embeddings"]))

    def loss(self) -> torch.Tensor:
        total = 0.0
        for mod, h, (cos, sin) in self.saved:
            total = total + self._one(mod, h.detach(), cos, sin)
        n = len(self.saved)
        self.saved = []
        return total / max(n, 1)

    def _one(self, mod, h, cos, sin):
        b, s, _ = h.shape
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        with torch.no_grad():  # the main attention's distribution (dense), the target
            q_resid = mod.q_a_layernorm(mod.q_a_proj(h))
            q = mod.q_b_proj(q_resid).view(b, s, -1, mod.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = torch.split(q, [mod.qk_nope_head_dim, mod.qk_rope_head_dim], dim=-1)
            ckv = mod.kv_a_proj_with_mqa(h)
            kv_pass, k_rot = torch.split(ckv, [mod.kv_lora_rank, mod.qk_rope_head_dim], dim=-1)
            k_pass = mod.kv_a_layernorm(kv_pass).view(b, 1, s, mod.kv_lora_rank)
            q_rot, k_rot = self.rope(q_rot, k_rot.view(b, 1, s, mod.qk_rope_head_dim), cos, sin)
            k, _ = mod.expand_kv(k_pass, k_rot)
            logits = torch.matmul(torch.cat((q_pass, q_rot), -1).float(), k.float().transpose(-1, -2)) * mod.scaling
            p = logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)
            p = p / p.sum(-1, keepdim=True)
        ix = mod.indexer
        q = ix.wq_b(q_resid.detach()).view(b, s, ix.n_heads, ix.head_dim)
        q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        k = ix.k_norm(ix.wk(h)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = self.rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], -1)
        k = torch.cat([k_rot, k_pass], -1).squeeze(2)
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
        w = ix.weights_proj(h.to(ix.weights_proj.weight.dtype)).float() * ix.n_heads**-0.5
        idx = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
        logq = idx.masked_fill(~causal, float("-inf")).log_softmax(-1)
        kl = (p * (p.clamp_min(1e-12).log() - logq.masked_fill(~causal, 0.0))).sum(-1)
        return kl.mean()


class RouterBalance:
    """Aux-loss-free load balancing: count each router's top-k choices, then nudge the bias."""

    def __init__(self, model, rate: float = 1e-3):
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

        self.rate = rate
        self.routers = [mod for mod in model.modules() if isinstance(mod, m.GlmMoeDsaTopkRouter)]
        self.counts = {id(r): None for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, mod, args, out):
        if mod.training:
            c = torch.bincount(out[2].reshape(-1), minlength=mod.num_experts).float()
            prev = self.counts[id(mod)]
            self.counts[id(mod)] = c if prev is None else prev + c

    @torch.no_grad()
    def update(self) -> float:
        worst = 0.0
        for r in self.routers:
            c = self.counts[id(r)]
            if c is None:
                continue
            r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            worst = max(worst, float(c.max() / c.mean()))
            self.counts[id(r)] = None
        return worst


def build_target(cfg: dict, device):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    hf_cfg = GlmMoeDsaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    return GlmMoeDsaForCausalLM(hf_cfg).to(device)


def save_target(model, cfg: dict, out: Path) -> None:
    """The trained weights under the checkpoint's names (the loader's inverse mapping:
    per-expert gate/up/down), bf16 except the router's correction bias (fp32)."""
    from safetensors.torch import save_file

    from glm53.server.embedded_model import weight_shapes

    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out_t = {}
    for name, (shape, dtype) in weight_shapes(cfg).items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            e, proj = int(parts[5]), parts[6]
            base = ".".join(parts[:5])
            if proj == "down_proj":
                t = sd[f"{base}.down_proj"][e]
            else:
                gu = sd[f"{base}.gate_up_proj"][e]
                t = gu[: gu.shape[0] // 2] if proj == "gate_proj" else gu[gu.shape[0] // 2 :]
        else:
            t = sd[name]
        assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
        out_t[name] = t.to(dtype).contiguous()
    save_file(out_t, str(out / "model.safetensors"), metadata={"format": "pt"})


def load_target(model, tdir: Path) -> None:
    """The checkpoint in `tdir` into a transformers target (save_target's inverse: per-expert
    tensors stacked back into gate_up_proj / down_proj), in fp32."""
    from safetensors.torch import load_file

    sd = load_file(str(tdir / "model.safetensors"))
    state = {}
    for n, p in model.state_dict().items():
        if n.endswith("experts.gate_up_proj"):
            base = n.removesuffix(".gate_up_proj")
            state[n] = torch.stack([torch.cat([sd[f"{base}.{e}.gate_proj.weight"], sd[f"{base}.{e}.up_proj.weight"]])
                                    for e in range(p.shape[0])])
        elif n.endswith("experts.down_proj"):
            base = n.removesuffix(".down_proj")
            state[n] = torch.stack([sd[f"{base}.{e}.down_proj.weight"] for e in range(p.shape[0])])
        else:
            state[n] = sd[n]
    model.load_state_dict({k: v.float() for k, v in state.items()})


@torch.no_grad()
def eval_target(model, stream, seq, n, device) -> float:
    g = torch.Generator().manual_seed(99)
    model.eval()
    tot = 0.0
    for _ in range(n // 16):
        x = batch_from(stream, 16, seq + 1, g, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits
        tot += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
    model.train()
    return tot / (n // 16)


def train_target(model, train, held, a, device) -> None:
    aux = IndexerAux(model)
    bal = RouterBalance(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.target_lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    model.train()
    budget = StepBudget(a.target_steps, a.target_seconds, "target")
    step = 0
    while step < budget.total:
        budget.tick(step)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, budget.total, a.target_lr, 30)
        x = batch_from(train, a.batch, a.seq + 1, g, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, :-1]).logits
            lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            ix = aux.loss()
        (lm + ix).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        worst = bal.update()
        if step % 50 == 0 or step == budget.total - 1:
            el = budget.elapsed()
            log(f"target step {step:5d} loss {lm.item():.3f} indexer_kl {float(ix.detach()):.3f} load_max/mean {worst:.2f} "
                f"{(step + 1) * a.batch * a.seq / el / 1e3:.0f}K tok/s {el:.0f}s")
        step += 1
    aux.enabled = False


# ---------------------------------------------------------------- draft
# (its training forward, loss, config and checkpoint writer: glm53.support.draft_trainer)

def sample_anchors(R, N, S, B, g, device):
    return torch.stack([torch.randperm(S - B, generator=g)[:N] + 1 for _ in range(R)]).clamp(max=S - B).sort(-1).values.to(device)


def target_features(model, x, layer_ids):
    out = model(x, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), out.logits


def train_draft(draft, model, train, held, a, device) -> None:
    embed = model.model.embed_tokens.weight.detach()
    lm_head = model.lm_head.weight.detach()
    opt = torch.optim.AdamW(draft.parameters(), lr=a.draft_lr, betas=(0.9, 0.95), weight_decay=0.01, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(2)
    budget = StepBudget(a.draft_steps, a.draft_seconds, "draft")
    step = 0
    model.eval()
    while step < budget.total:
        budget.tick(step)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, budget.total, a.draft_lr, 30)
        x = batch_from(train, a.batch, a.seq, g, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            with torch.no_grad():
                feats, _ = target_features(model, x, draft.ids)
            anchors = sample_anchors(a.batch, a.anchors, a.seq, draft.B, g, device)
            loss, acc_len = draft_loss(draft(x, feats, anchors, embed, lm_head), x, anchors, draft.B)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == budget.total - 1:
            log(f"draft step {step:5d} loss {loss.item():.3f} accepted(teacher-forced) {acc_len.item():.2f} "
                f"{budget.elapsed():.0f}s")
        step += 1


@torch.no_grad()
def eval_draft(draft, model, held, a, device) -> dict:
    """Offline acceptance on held-out windows against the target's own greedy next tokens:
    a block's accepted length = matching prefix of the draft's argmax and the target's argmax
    continuing from the anchor when the target is fed ground truth (teacher forcing; τ from the
    real decode loop comes from tools/eval_dflash.py)."""
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    g = torch.Generator().manual_seed(98)
    x = batch_from(held, 32, a.seq, g, device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        feats, tl = target_features(model, x, draft.ids)
        anchors = sample_anchors(32, a.anchors, a.seq, draft.B, g, device)
        loss, acc_gt = draft_loss(draft(x, feats, anchors, embed, lm_head), x, anchors, draft.B)
    return {"draft_heldout_loss": loss.item(), "draft_heldout_accept_teacher_forced": acc_gt.item()}


# ---------------------------------------------------------------- CPU check

def check(tmp: Path) -> None:
    """On tiny random shapes: the saved target loads in our loader with nothing missing or
    unexpected, the saved draft loads with `DFlashConfig.from_dir` + `load_draft_weights`, and
    the training forward's logits/proposals equal `DFlashDraft.propose` on the same weights."""
    from glm53.models import DFlashConfig, DFlashDraft, DraftBlock, GlmConfig, GlmForCausalLM, KVPools, load_draft_weights, load_weights
    from glm53.models.draft import add_draft_pools

    global TARGET_DIMS
    TARGET_DIMS = {**TARGET_DIMS, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                   "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                   "v_head_dim": 16, "index_topk": 8, "index_head_dim": 32}
    draft_dims = dict(n_layers=2, block_size=6, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
    tdir = tmp / "target"
    tok, cfg = write_target_files(tdir)
    dev = torch.device("cpu")
    model = build_target(cfg, dev).float()
    with torch.no_grad():  # move off the init so that every tensor matters
        gen = torch.Generator().manual_seed(3)
        for n, p in model.named_parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    save_target(model, cfg, tdir)
    tcfg = GlmConfig.from_dir(tdir)
    ours = GlmForCausalLM(tcfg)
    load_weights(ours, tdir, progress=False)
    log("check: our loader takes the trained-layout target (no missing/unexpected tensors)")
    # the round trip keeps the function: HF and ours agree on the logits (bf16 weights in both)
    model_b = build_target(cfg, dev)
    load_target(model_b, tdir)
    model_b.eval()
    x = torch.randint(0, 4000, (1, 8))  # dense (<= index_topk): no top-k ties from random relu scores
    with torch.no_grad():
        ref = model_b(x).logits[0, -1].float()
        from glm53.models import ModelRunner, PageAllocator, SeqChunk
        runner = ModelRunner.from_dir(tdir, page_size=4, num_pages=64, device="cpu", dtype=torch.float32, progress=False)
        got = runner.forward([SeqChunk(x[0].tolist(), 0, PageAllocator(64).alloc(10))])[0][-1]
    err = (got.float() - ref).abs().max().item()
    log(f"check: our model vs transformers on the saved weights, max |last-position logit diff| {err:.2e}")
    assert err < 1e-3, err

    dcfg = draft_config(tdir, draft_dims)
    torch.manual_seed(5)
    draft = DraftTrainer(dcfg)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape))
    ddir = tmp / "draft"
    save_draft(draft, dcfg, ddir, dtype=torch.float32)
    dc = DFlashConfig.from_dir(ddir, tcfg)
    real = DFlashDraft(dc, tcfg)
    load_draft_weights(real, ddir)
    log("check: DFlashConfig.from_dir + load_draft_weights take the draft")

    S, B = 30, dc.block_size
    ids = torch.randint(0, 4000, (1, S))
    with torch.no_grad():
        feats, _ = target_features(model_b, ids, draft.ids)
        anchors = torch.tensor([[7, 19, S - B]])
        logits = draft(ids, feats, anchors, model_b.model.embed_tokens.weight, model_b.lm_head.weight)[0]
    pools = KVPools(64, 4)
    add_draft_pools(pools, real)
    pos = torch.arange(S)
    captures = {i: feats[0, :, k * 64 : (k + 1) * 64] for k, i in enumerate(draft.ids)}
    real.write_context(real.context(real.partial_projection(captures)), pos, pos, pools)  # page p = slot p // 4
    table = list(range(16))
    blocks = [DraftBlock(int(ids[0, p]), int(p), table) for p in anchors[0].tolist()]
    toks, rl = real.propose(ours, blocks, pools, return_logits=True)
    err = (rl - logits).abs().max().item()
    log(f"check: training forward vs DFlashDraft.propose, max |logit diff| {err:.2e}, proposals equal: "
        f"{torch.equal(toks, logits.argmax(-1))}")
    assert err < 1e-3 and torch.equal(toks, logits.argmax(-1))
    # the draft's loss runs and has gradients everywhere
    loss, _ = draft_loss(draft(ids, feats, anchors, model_b.model.embed_tokens.weight, model_b.lm_head.weight), ids, anchors, B)
    loss.backward()
    assert all(p.grad is not None for p in draft.parameters())
    # one target training step with the indexer loss gives the indexer a gradient
    model.train()
    aux = IndexerAux(model)
    lm = F.cross_entropy(model(ids[:, :-1]).logits.reshape(-1, model.config.vocab_size), ids[:, 1:].reshape(-1))
    (lm + aux.loss()).backward()
    gi = [p.grad for n, p in model.named_parameters() if ".indexer." in n]
    assert gi and all(g_ is not None and g_.abs().sum() > 0 for g_ in gi)
    log("check: OK")


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--check", action="store_true", help="CPU layout/equivalence checks on tiny shapes, then exit")
    ap.add_argument("--target-seconds", type=float, default=270)
    ap.add_argument("--draft-seconds", type=float, default=170)
    ap.add_argument("--target-steps", type=int, default=0)
    ap.add_argument("--draft-steps", type=int, default=0)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=1.5e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--corpus", type=Path, help="a Python standard library source tree (default: this Python's)")
    a = ap.parse_args()
    if a.corpus:
        os.environ["GLM53_CORPUS"] = str(a.corpus)
    if a.check:
        check(a.out)
        return
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    files = stdlib_files()
    train_f = [f for f in files if not held_out(f[0])]
    held_f = [f for f in files if held_out(f[0])]
    tdir, ddir = a.out / "tiny-glm5", a.out / "tiny-glm5-dflash"
    tok, cfg = write_target_files(tdir)
    eos = tok.token_to_id("<|endoftext|>")
    train, held = tokenize(tok, train_f, eos), tokenize(tok, held_f, eos)
    log(f"corpus: {len(train_f)} train files ({len(train)} tokens), {len(held_f)} held-out files ({len(held)} tokens), "
        f"python {sys.version.split()[0]}, {time.time() - t0:.0f}s")
    model = build_target(cfg, device)
    log(f"target params {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    results = {}
    train_target(model, train, held, a, device)
    results["target_heldout_loss"] = eval_target(model, held, a.seq, 128, device)
    results["target_train_loss"] = eval_target(model, train, a.seq, 128, device)
    log(f"target held-out loss {results['target_heldout_loss']:.3f} (train {results['target_train_loss']:.3f})")
    save_target(model, cfg, tdir)
    for p in model.parameters():
        p.requires_grad_(False)
    dcfg = draft_config(tdir)
    torch.manual_seed(7)
    draft = DraftTrainer(dcfg).to(device)
    log(f"draft params {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M, target_layer_ids {draft.ids}")
    train_draft(draft, model, train, held, a, device)
    results.update(eval_draft(draft, model, held, a, device))
    save_draft(draft, dcfg, ddir)
    log("results " + json.dumps(results))
    (a.out / "train_results.json").write_text(json.dumps(results, indent=2) + "\n")
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

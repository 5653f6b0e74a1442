"""GLM-5's MTP (NextN) layer as a draft (models/mtp.py): its loader and the config error of a
checkpoint without it, one step against a plain-torch reference of the NextN formulas, the
decode loop greedy equal to plain greedy decoding with exact verify counts for a constructed
layer that proposes a fixed successor of each token, and sampled proposals lossless."""

from __future__ import annotations

import math

import pytest
import torch

from glm53.models import DraftBlock, GlmConfig, ModelRunner, SeqChunk
from glm53.models.config import ConfigError
from glm53.models.draft import DraftSampling
from glm53.models.mtp import MTP_INDEX_K, MTP_KV, BlockSampling, nextn_spec
from glm53.models.mtp_weights import build_nextn
from glm53.models.weights import checkpoint_files, load_model
from glm53.server.engine.spec import accept
from glm53.server.sampling import SamplingParams, filter_logits
from glm53.support.mtp_checkpoint import random_nextn, write_mtp_layer
from glm53.support.oracle import make_checkpoint

PAGE, PAGES = 4, 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp") / "target"
    make_checkpoint(d, seed=81, index_topk_freq=2, index_skip_topk_offset=2)
    write_mtp_layer(d, random_nextn(GlmConfig.from_dir(d), seed=82))
    return d


@pytest.fixture(scope="module")
def own_head(tmp_path_factory):
    """A layer with its own shared_head.head (the successor test aims it)."""
    d = tmp_path_factory.mktemp("mtp_head") / "target"
    make_checkpoint(d, seed=84)
    write_mtp_layer(d, random_nextn(GlmConfig.from_dir(d), seed=85, own_head=True))
    return d


def runner(d, steps=3, **kw) -> ModelRunner:
    return ModelRunner.from_dir(d, page_size=PAGE, num_pages=PAGES, progress=False, nextn_steps=steps, **kw)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_loader_and_missing_layer(ckpt, tmp_path):
    cfg = GlmConfig.from_dir(ckpt)
    spec = nextn_spec(cfg, checkpoint_files(ckpt))
    assert (spec.layer, spec.moe, spec.own_head, spec.own_embed) == (cfg.num_hidden_layers, True, False, False)
    d = tmp_path / "plain"
    make_checkpoint(d, seed=83)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        build_nextn(d, dtype=torch.float32)
    # The target alone still loads a checkpoint with the layer (it skips it).
    load_model(ckpt, dtype=torch.float32, progress=False)


def test_step_matches_reference(ckpt):
    """rows(): eh_proj([enorm(embed(t)), hnorm(h)]) through the decoder layer, shared_head.norm;
    its latent row lands in mtp_kv at the row's slot; the head is the target's lm_head."""
    r = runner(ckpt)
    mtp, cfg = r.mtp, r.cfg
    g = torch.Generator().manual_seed(5)
    n = 6
    toks = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    hidden = torch.randn(n, cfg.hidden_size, generator=g)
    batch, _ = r.build_batch([SeqChunk(toks, 0, [3, 9])])
    got = mtp.rows(batch.input_ids, hidden, batch)
    L, eps = mtp.layer, cfg.rms_norm_eps
    e = rms(r.model.model.embed_tokens.weight[torch.tensor(toks)], L.enorm.weight, eps)
    x = torch.cat([e, rms(hidden, L.hnorm.weight, eps)], -1) @ L.eh_proj.weight.T
    # The decoder layer itself is the target's (checked against transformers); run it on x.
    from glm53.kernels.rope import rope_cos_sin
    cos, sin = rope_cos_sin(batch.positions, mtp.inv_freq)
    y, _ = type(L).__mro__[1].forward(L, x, cos, sin, batch, mtp.kv, None)
    want = rms(y, L.shared_head.norm.weight, eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lat = r.pools[MTP_KV].view(cfg.num_hidden_layers)
    slots = batch.out_slots
    row = lat[slots // PAGE, slots % PAGE]
    assert row.abs().sum(-1).gt(0).all() and r.pools[MTP_INDEX_K].view(cfg.num_hidden_layers).abs().sum() > 0
    logits = mtp.head_logits(got)
    torch.testing.assert_close(logits, (got @ r.model.lm_head.weight.T).float())


def successor_layer(r: ModelRunner, pairs: dict[int, int]) -> list[int]:
    """Makes the MTP layer ignore h and its context (eh_proj reads only the embedding half, as
    the identity; attention and MLP outputs zero), so it proposes succ(t) for input token t, with
    its own head aimed at `pairs` (t -> wanted successor); returns succ as the weights give it."""
    L, H = r.mtp.layer, r.cfg.hidden_size
    eps = r.cfg.rms_norm_eps
    with torch.no_grad():
        L.eh_proj.weight.zero_()
        L.eh_proj.weight[:, :H] = torch.eye(H)
        L.self_attn.o_proj.weight.zero_()
        L.mlp.experts.down_proj.zero_()
        L.mlp.shared_experts.down_proj.weight.zero_()
        ids = torch.arange(r.cfg.vocab_size)
        e = rms(r.model.model.embed_tokens.weight[ids], L.enorm.weight, eps)
        h = rms(e, L.shared_head.norm.weight, eps)
        head = L.shared_head.head.weight
        head.zero_()
        for t, u in pairs.items():
            head[u] += h[t]
        return (h @ head.T).argmax(-1).tolist()


def plain_greedy(d, prompt, n) -> list[int]:
    r = ModelRunner.from_dir(d, page_size=PAGE, num_pages=PAGES, progress=False)
    pages = list(range(PAGES // 2))
    out = [int(r.forward([SeqChunk(prompt, 0, pages)])[0][-1].argmax())]
    while len(out) < n:
        out.append(int(r.forward([SeqChunk([out[-1]], len(prompt) + len(out) - 1, pages)])[0][-1].argmax()))
    return out


def spec_loop(r, prompts, n, params=None, forced=None, seed=False, ctx=False):
    """The decode loop over a batch: prefill each prompt, then spec steps; per request its
    output and the accepted count of every step. `seed`: the first step's blocks carry the
    prompt's last hidden row (as prefill sends it), so that step drafts too. `ctx`: decode
    without the prompt's MTP KV (draft_kv_transfer false): ctx_start = the prompt's length."""
    pages = [list(range(i * 16, i * 16 + 16)) for i in range(len(prompts))]
    outs, seeds = [], []
    for p, pg in zip(prompts, pages):
        lg = r.forward([SeqChunk(p, 0, pg)])
        outs.append([int(lg[0][-1].argmax())])
        seeds.append(lg.last_hidden[0] if seed else None)
    counts = [[] for _ in prompts]
    drafts_seen = [[] for _ in prompts]
    step = 0
    while any(len(o) < n for o in outs):
        idx = [i for i, o in enumerate(outs) if len(o) < n]
        blocks = []
        for i in idx:
            s = len(prompts[i]) + len(outs[i]) - 1
            samp = None
            if params is not None:
                samp = DraftSampling(params.temperature, params.top_k, params.top_p, params.min_p, seed=1000 * step + i)
            blocks.append(DraftBlock(outs[i][-1], s, pages[i], block_size=min(r.mtp.block_size, n - len(outs[i])),
                                     key=i, sampling=samp, ctx_start=len(prompts[i]) if ctx else 0,
                                     seed_hidden=seeds[i] if step == 0 else None))
        res = r.spec_step(blocks)
        for j, i in enumerate(idx):
            q = res.probs[j] if res.probs else None
            p = params or SamplingParams(temperature=0.0)
            toks = accept(res.drafts[j], res.logits[j], p, first_step=len(outs[i]), q=q)
            toks = toks[: n - len(outs[i])]
            drafts_seen[i].append((list(outs[i]), res.drafts[j]))
            outs[i].extend(toks)
            counts[i].append(len(toks))
        step += 1
    return outs, counts, drafts_seen


@pytest.mark.parametrize("seed", [False, True])
def test_greedy_equals_plain_with_exact_counts(own_head, seed):
    """A successor layer's proposals are known offline: each step drafts succ(last),
    succ(succ(last)), ...; the accepted count is the matching prefix against the target's own
    greedy continuation. Without the seed nothing is drafted at a request's first step (no
    target hidden kept); with prefill's seed row the first step drafts the full chain."""
    prompts = [[5, 17, 33, 8, 90, 41, 2], [120, 7, 7, 64, 3]]
    n = 14
    want = [plain_greedy(own_head, p, n) for p in prompts]
    r = runner(own_head)
    pairs = {}
    for w in want:
        for a, b in zip(w, w[1:]):
            pairs.setdefault(a, b)
    succ = successor_layer(r, pairs)
    outs, counts, seen = spec_loop(r, prompts, n, seed=seed)
    assert outs == want
    for i, p in enumerate(prompts):
        pos = 1
        for k, c in enumerate(counts[i]):
            cap = min(r.mtp.block_size, n - pos)
            chain, t = [], want[i][pos - 1]
            if k > 0 or seed:
                for _ in range(cap - 1):
                    t = succ[t]
                    chain.append(t)
            assert seen[i][k][1] == chain
            a = 0
            while a < len(chain) and chain[a] == want[i][pos + a]:
                a += 1
            assert c == min(a + 1, n - pos)
            pos += c
    # Aimed at the target's own continuation, most steps commit several tokens.
    assert max(max(c) for c in counts) == r.mtp.block_size and sum(map(len, counts)) < n


def test_random_layer_greedy_equals_plain(ckpt):
    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [44, 45]]
    n = 12
    r = runner(ckpt, steps=2)
    outs, _, _ = spec_loop(r, prompts, n)
    assert outs == [plain_greedy(ckpt, p, n) for p in prompts]


def test_first_step_drafts_from_the_seed(ckpt):
    """The seeded first step: its first proposal is the MTP row at the prompt's last position
    (prefill's hidden row there, the first token as its next token) through the head, and its
    chain continues from it; greedy output still equals plain decoding."""
    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [44, 45, 46]]
    n = 10
    r = runner(ckpt)
    pg = list(range(16))
    lg = r.forward([SeqChunk(prompts[0], 0, pg)])
    first = int(lg[0][-1].argmax())
    batch, _ = r.build_batch([SeqChunk([first], len(prompts[0]) - 1, pg)])
    # The same row prefill wrote (greedy: its next token is the first token): rewriting it is idempotent.
    d1 = int(r.mtp.head_logits(r.mtp.rows(batch.input_ids, lg.last_hidden, batch)).argmax())
    r2 = runner(ckpt)
    outs, counts, seen = spec_loop(r2, prompts, n, seed=True)
    assert outs == [plain_greedy(ckpt, p, n) for p in prompts]
    assert seen[0][0][1][0] == d1
    assert all(len(s[0][1]) == r2.mtp.num_steps for s in seen)


def test_without_prompt_kv_the_mask_hides_it(ckpt):
    """draft_kv_transfer false: decode holds no MTP KV at the prompt's positions (ctx_start = P).
    The MTP's attention hides them: its drafts do not depend on what the pool holds there (zeros
    or large random rows; finite, as a pool's stale rows are: sparse MLA reads padding slots at
    weight 0), and greedy output equals plain decoding."""
    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13, 14], [44, 45]]
    n = 12
    runs = []
    for fill in ("zero", "rand"):
        r = runner(ckpt)
        real = r.forward  # prefill without the MTP pools' contents: overwrite the prompt's rows

        def forward(chunks, _real=real, _r=r, _fill=fill):
            out = _real(chunks)
            for c in chunks:
                if len(c.token_ids) > 1:
                    for name in (MTP_KV, MTP_INDEX_K):
                        v = _r.pools[name].view(_r.cfg.num_hidden_layers)
                        for j in range(len(c.token_ids)):
                            pgi, off = c.page_table[j // PAGE], j % PAGE
                            v[pgi, off] = 0.0 if _fill == "zero" else torch.randn(v.shape[-1]) * 50
            return out

        r.forward = forward
        outs, counts, seen = spec_loop(r, prompts, n, ctx=True)
        assert outs == [plain_greedy(ckpt, p, n) for p in prompts]
        assert all(0 <= t < r.cfg.vocab_size for s in seen for _, d in s for t in d)
        runs.append(seen)
    assert runs[0] == runs[1]
    assert any(d for s in runs[0] for _, d in s)


def chi_square_p(counts, probs):
    n = sum(counts)
    cells = [(c, n * q) for c, q in zip(counts, probs) if q > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    k = len(cells) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.2, top_k=5, top_p=0.9)])
def test_sampled_chain_is_lossless(ckpt, kw):
    """The MTP's sampled proposals (`sampled_proposal`: q under the request's filters, drawn by
    inverse CDF; the second step's logits depend on the first proposal, as a chain's do) accepted
    with min(1, p/q): both committed tokens follow the target's p."""
    r = runner(ckpt)
    V, n = 24, 3000
    g = torch.Generator().manual_seed(9)
    target_logits = torch.randn(3, V, generator=g) * 1.5
    step1 = target_logits[0] + torch.randn(V, generator=g)
    succ_bias = torch.randn(V, V, generator=g)
    p0 = SamplingParams(**kw)
    s = BlockSampling(rows=torch.ones(n, dtype=torch.bool), temperature=torch.full((n,), p0.temperature),
                      top_k=torch.full((n,), p0.top_k if p0.top_k > 0 else V), top_p=torch.full((n,), p0.top_p),
                      min_p=torch.full((n,), p0.min_p), uniforms=torch.rand(n, 2, dtype=torch.float64, generator=g))
    d1, q1 = r.mtp.sampled_proposal(step1.expand(n, V).contiguous(), s, 0)
    d2, q2 = r.mtp.sampled_proposal(target_logits[1] + succ_bias[d1], s, 1)
    target = torch.softmax(filter_logits(target_logits / p0.temperature, [p0] * 3), -1)
    first, second = [0] * V, [0] * V
    for i in range(n):
        toks = accept([int(d1[i]), int(d2[i])], target_logits, SamplingParams(seed=i, **kw), first_step=0,
                      q=torch.stack([q1[i], q2[i]]))
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
    assert chi_square_p(first, target[0].tolist()) > 1e-3
    assert chi_square_p(second, target[1].tolist()) > 1e-3


def test_sampled_decode_runs_and_samples_from_q(ckpt):
    """Sampled requests get q rows from the spec step, one per draft, each a distribution."""
    r = runner(ckpt)
    outs, counts, _ = spec_loop(r, [[3, 4, 5, 6]], 10, params=SamplingParams(temperature=0.9, seed=3))
    assert len(outs[0]) == 10 and sum(counts[0]) == 9


def test_trainer_forward_equals_serving(ckpt):
    """The differentiable training forward (support/mtp_trainer.py, DSA selection from the
    serving indexer) gives the serving rows() on sequences longer than index_topk."""
    from glm53.support.mtp_trainer import train_rows

    r = runner(ckpt)
    cfg = r.cfg
    g = torch.Generator().manual_seed(12)
    seq, b = 20, 2
    toks = torch.randint(0, cfg.vocab_size, (b, seq), generator=g)
    hidden = torch.randn(b * seq, cfg.hidden_size, generator=g)
    chunks = [SeqChunk(toks[i].tolist(), 0, list(range(8 * i, 8 * i + 8))) for i in range(b)]
    batch, _ = r.build_batch(chunks)
    assert seq > cfg.index_topk
    want = r.mtp.rows(batch.input_ids, hidden, batch)
    got = train_rows(r.mtp, batch.input_ids, hidden, batch, seq)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seed_rides_the_metadata_row(dtype):
    """Prefill's seed row heads the commit record's payload (counts[2] bytes, counts[3] dtype),
    before the first token's logprobs; a slot sized meta_slot_bytes() + seed_bytes holds both at
    GLM-5's hidden size with the most choices and top logprobs; decode gets both back."""
    from glm53.server.engine.logprobs import meta_slot_bytes, pack_first, unpack_first
    from glm53.server.engine.mtp_seed import pack_seed, seed_bytes, split_payload
    from glm53.server.protocol import MAX_CHOICES, MAX_TOP_LOGPROBS
    from glm53.transport.buffers import MetadataRow

    H = 6144
    h = torch.randn(H).to(dtype)
    lp = pack_first([-0.5] * MAX_CHOICES, [[(i, -1.0)] * MAX_TOP_LOGPROBS for i in range(MAX_CHOICES)])
    raw, code = pack_seed(h)
    assert len(raw) == seed_bytes(H, dtype)
    row = MetadataRow(first_token_ids=tuple(range(MAX_CHOICES)), counts=(40, 40, len(raw), code), payload=raw + lp)
    slot = meta_slot_bytes() + seed_bytes(H, dtype)
    back = MetadataRow.decode(row.encode(slot, 3, 1), 3, 1)
    seed, rest = split_payload(back.counts, bytes(back.payload))
    assert seed.dtype == dtype and torch.equal(seed, h)
    assert unpack_first(rest) == unpack_first(lp)
    # No seed (DFlash, or the draft KV not sent): the payload is the logprobs alone.
    plain = MetadataRow.decode(MetadataRow(first_token_ids=(1,), counts=(40, 0), payload=lp).encode(slot, 3, 1), 3, 1)
    assert split_payload(plain.counts, bytes(plain.payload)) == (None, lp)


def test_warmup_covers_the_masked_catch_ups_unpaged_topk(ckpt, monkeypatch):
    """Decoding without the prompt's MTP KV (ctx_start > 0) selects top-k unpaged
    (model._topk_from: dsa_topk, not dsa_topk_paged: other compiled variants); the warm-up of an
    MTP rank launches every top-k key that way too."""
    from glm53.kernels import topk, variants
    from glm53.models import model as model_mod, warmup

    rows: list[tuple[int, int]] = []

    def recorded(logits, lengths, k, _real=topk.dsa_topk):
        rows.append(tuple(logits.shape))
        return _real(logits, lengths, k)

    for mod in (topk, model_mod, warmup):
        monkeypatch.setattr(mod, "dsa_topk", recorded, raising=False)
    r = runner(ckpt)
    tokens, ctx = 16, PAGES * PAGE
    shape = warmup.serve_shape(r, tokens, ctx)
    warmup.warm_up(r, tokens, ctx, force=True)
    warmed = {variants.topk_key(b, w, shape) for b, w in rows}
    rows.clear()
    spec_loop(r, [[5, 17, 33, 8, 90, 41, 2], [120, 7, 7, 64, 3, 9, 9, 1, 4]], 10, ctx=True)
    served = {variants.topk_key(b, w, shape) for b, w in rows}
    assert served and served <= warmed, served - warmed

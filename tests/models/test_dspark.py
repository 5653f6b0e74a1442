"""The DSpark draft (models/dspark.py on the DFlash draft): its checkpoint (r and the confidence
head from the tensors, `dspark_config`, errors naming tensors), its greedy block and confidence
cut against a plain-torch reference of the formulas on fresh random inputs, exact verify counts
of the real spec step with a Markov head whose proposal chains are known offline (cut short by
the confidence head), and sampled drafting: q and the drawn tokens against the reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm53.models import (
    DFlashDraft, DraftBlock, DraftSampling, GlmConfig, GlmForCausalLM, KVPools, ModelRunner, PageAllocator,
    SeqChunk, WeightError, add_draft_pools, build_draft, draft_config,
)
from glm53.models.dspark import choose_block, inverse_cdf
from glm53.models.weights import load_weights
from glm53.support.oracle import make_checkpoint
from tests.models.draft_oracle import (
    RefDraft, chain_verify_steps, make_draft_checkpoint, write_successor_heads,
)

IDS = [1, 2, 4]
PAGE, PAGES, V, RANK = 4, 48, 160, 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    make_checkpoint(root / "target", seed=71, index_topk_freq=2, index_skip_topk_offset=2)
    ref = make_draft_checkpoint(root / "draft", root / "target", seed=72, target_layer_ids=IDS, block_size=6,
                                markov_rank=RANK, confidence_head=True)
    return root / "target", root / "draft", ref


def load(ckpts, threshold: float = 0.0) -> tuple[GlmForCausalLM, DFlashDraft]:
    target_dir, draft_dir, _ = ckpts
    tcfg = GlmConfig.from_dir(target_dir)
    target = GlmForCausalLM(tcfg)
    load_weights(target, target_dir, progress=False)
    return target, build_draft(draft_dir, tcfg, confidence_threshold=threshold)


def test_checkpoint_heads_come_from_the_tensors(ckpts, tmp_path):
    target_dir, draft_dir, _ = ckpts
    tcfg = GlmConfig.from_dir(target_dir)
    cfg = draft_config(draft_dir, tcfg)
    assert (cfg.algorithm, cfg.markov_rank, cfg.confidence_head) == ("DSPARK", RANK, True)
    assert cfg.target_layer_ids == tuple(IDS) and "dspark_config" in json.loads((draft_dir / "config.json").read_text())
    sd = load_file(str(draft_dir / "model.safetensors"))

    def write(tensors, name):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((draft_dir / "config.json").read_text())
        save_file(tensors, str(d / "model.safetensors"))
        return d

    no_conf = {k: v for k, v in sd.items() if not k.startswith("confidence_head.")}
    c2 = draft_config(write(no_conf, "noconf"), tcfg)
    assert (c2.markov_rank, c2.confidence_head) == (RANK, False)
    plain = {k: v for k, v in no_conf.items() if not k.startswith("markov_head.")}
    assert draft_config(write(plain, "plain"), tcfg).algorithm == "DFLASH"
    with pytest.raises(WeightError, match="missing from the draft checkpoint: markov_head.markov_w2.weight"):
        draft_config(write({k: v for k, v in sd.items() if "markov_w2" not in k}, "halfmarkov"), tcfg)
    with pytest.raises(WeightError, match="confidence_head.proj.weight.*without a Markov head"):
        draft_config(write({**plain, **{k: sd[k] for k in sd if k.startswith("confidence_head.")}}, "orphan"), tcfg)
    with pytest.raises(WeightError, match=r"\[vocab=160, r\]"):
        draft_config(write({**sd, "markov_head.markov_w1.weight": torch.zeros(100, RANK)}, "badvocab"), tcfg)
    with pytest.raises(WeightError, match=r"confidence_head.proj.weight: shape \(1, 70\)"):
        build_draft(write({**sd, "confidence_head.proj.weight": torch.zeros(1, 70)}, "badproj"), tcfg)


def _blocks_over_context(draft, pools, block, g):
    """Three requests with random written features (scattered pages): (blocks, the reference's
    visible context K/V per request)."""
    written, starts, ctx_starts = [11, 6, 17], [8, 6, 17], [0, 0, 5]
    alloc = PageAllocator(PAGES)
    held = [alloc.alloc(1) for _ in range(20)]
    for h in held[::2]:
        alloc.free(h)
    pages = [alloc.alloc(-(-(n + block) // PAGE)) for n in written]
    feats = [{i: torch.randn(n, 64, generator=g) for i in IDS} for n in written]
    positions = torch.cat([torch.arange(n) for n in written])
    slots = torch.cat([torch.tensor([pg[p // PAGE] * PAGE + p % PAGE for p in range(n)])
                       for n, pg in zip(written, pages)])
    draft.write_context(draft.context(draft.partial_projection({i: torch.cat([f[i] for f in feats]) for i in IDS})),
                        positions, slots, pools)
    last = torch.randint(0, V, (3,), generator=g).tolist()
    blocks = [DraftBlock(t, s, pg, c, block) for t, s, pg, c in zip(last, starts, pages, ctx_starts)]
    return blocks, feats, written


@pytest.mark.parametrize("block", [4, 6])
def test_greedy_block_and_confidence_cut_match_the_reference(ckpts, block):
    ref: RefDraft = ckpts[2]
    target, draft = load(ckpts)
    pools = KVPools(PAGES, PAGE)
    add_draft_pools(pools, draft)
    blocks, feats, written = _blocks_over_context(draft, pools, block, torch.Generator().manual_seed(block))
    cuts, confs = set(), []
    thresholds = [0.0]
    while thresholds:
        threshold = thresholds.pop(0)
        draft.confidence_threshold = threshold
        choice, logits = draft.draft_block(target, blocks, pools)
        for r, blk in enumerate(blocks):
            kv = ref.context_kv(ref.context(feats[r]), torch.arange(written[r]))
            visible = [(k[blk.ctx_start : blk.start_pos], v[blk.ctx_start : blk.start_pos]) for k, v in kv]
            _, want_logits = ref.propose(visible, blk.last_token, blk.start_pos, block)
            torch.testing.assert_close(logits[r], want_logits, rtol=1e-4, atol=1e-4)
            tokens, keep = ref.dspark(want_logits, ref.hidden, blk.last_token, threshold)
            assert choice.tokens[r].tolist() == tokens and int(choice.keep[r]) == keep, (threshold, r)
            cuts.add(keep)
            confs += ref.confidences if threshold == 0 else []
        if threshold == 0:  # then thresholds between the reference's own confidences
            c = sorted(confs)
            thresholds = [(c[i] + c[i + 1]) / 2 for i in (len(c) // 5, len(c) // 2, 4 * len(c) // 5)]
    assert len(cuts) > 2, cuts  # the thresholds cut at different places, none included
    assert block - 1 in cuts  # threshold 0: never cut


def test_verify_counts_follow_the_known_proposal_chain(ckpts, tmp_path):
    """Markov head: every token proposes a fixed successor (taken from the target's own greedy
    output, so chains are often right and sometimes wrong); confidence: low after some tokens.
    The spec step's per-verify commits then equal the offline chain's, and the output equals
    non-speculative greedy decoding."""
    target_dir, _, _ = ckpts
    draft_dir = tmp_path / "chain"
    make_draft_checkpoint(draft_dir, target_dir, seed=73, target_layer_ids=IDS, block_size=5)
    runner = ModelRunner.from_dir(target_dir, page_size=PAGE, num_pages=PAGES, progress=False, draft_dir=draft_dir)
    prompt, new = [5, 17, 33, 2, 90, 41, 7], 20
    n_pages = -(-(len(prompt) + new) // PAGE)
    pages, plain_pages = list(range(n_pages)), list(range(n_pages, 2 * n_pages))
    greedy = []  # non-speculative greedy decoding (its own pages)
    for pos in range(new):
        ids = prompt if pos == 0 else greedy[-1:]
        start = 0 if pos == 0 else len(prompt) + pos - 1
        greedy.append(int(runner.forward([SeqChunk(ids, start, plain_pages)])[0][-1].argmax()))
    succ, confident = {}, {}
    for a, b in zip(greedy, greedy[1:]):
        succ.setdefault(a, b)
    for t in set(greedy):
        succ.setdefault(t, greedy[0])
        confident[t] = t % 3 != 0
    assert not all(confident.values()) and any(confident.values())
    write_successor_heads(draft_dir, succ, confident, V)
    # The same draft plus its heads (same fc, same draft KV pool), cutting at 0.5.
    runner.draft = runner.projection = build_draft(draft_dir, runner.cfg, confidence_threshold=0.5)
    out = [int(runner.forward([SeqChunk(prompt, 0, pages)])[0][-1].argmax())]
    steps = []
    while len(out) < new:
        n = min(5, new - len(out))
        res = runner.spec_step([DraftBlock(out[-1], len(prompt) + len(out) - 1, pages, block_size=n)])
        d, am = res.drafts[0], res.greedy[0]
        a = 0
        while a < len(d) and d[a] == am[a]:
            a += 1
        out += d[:a] + [am[a]]
        steps.append(a + 1)
    want = chain_verify_steps(greedy[0], greedy, 5, succ, confident)
    assert out == greedy and steps == want
    assert len(set(want)) > 2  # full blocks, rejections and cuts all occurred


def test_sampled_block_draws_from_q_of_the_sampled_predecessor(ckpts):
    """Sampled drafting: q_i = softmax(filter((logits_i + bias(token_{i−1})) / T)) with token_{i−1}
    the *sampled* predecessor, token_i = the inverse CDF of q_i at the block's seeded uniform;
    a greedy row in the same batch still proposes its argmax chain."""
    ref: RefDraft = ckpts[2]
    target, draft = load(ckpts)
    pools = KVPools(PAGES, PAGE)
    add_draft_pools(pools, draft)
    blocks, feats, written = _blocks_over_context(draft, pools, 6, torch.Generator().manual_seed(11))
    s = DraftSampling(temperature=0.8, top_k=40, top_p=0.9, min_p=0.0, seed=1234)
    blocks[0].sampling, blocks[2].sampling = s, DraftSampling(1.3, 0, 1.0, 0.05, 99)
    choice, logits = draft.draft_block(target, blocks, pools)
    w1, w2 = ref.w["markov_head.markov_w1.weight"], ref.w["markov_head.markov_w2.weight"]
    for r, blk in enumerate(blocks):
        sp = blk.sampling
        if sp is None:
            kv = ref.context_kv(ref.context(feats[r]), torch.arange(written[r]))
            ref.propose([(k[blk.ctx_start : blk.start_pos], v[blk.ctx_start : blk.start_pos]) for k, v in kv],
                        blk.last_token, blk.start_pos, 6)
            assert choice.tokens[r].tolist() == ref.dspark(logits[r], ref.hidden, blk.last_token, 0.0)[0]
            continue
        u = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(sp.seed))
        prev = blk.last_token
        for i in range(5):
            x = (logits[r, i] + w2 @ w1[prev]) / sp.temperature
            q = torch.softmax(ref_filter(x, sp.top_k, sp.top_p, sp.min_p), dim=-1)
            torch.testing.assert_close(choice.probs[r, i], q, rtol=1e-5, atol=1e-6)
            cdf = q.double().cumsum(0)
            want = int((cdf <= u[i]).sum())
            assert int(choice.tokens[r, i]) == want and q[want] > 0
            prev = want
    # The same seed draws the same block (every rank, every run).
    again, _ = draft.draft_block(target, blocks, pools)
    assert torch.equal(again.tokens, choice.tokens)


def test_choose_reads_bf16_logits_as_their_fp32_cast(ckpts):
    """The graphs hand `choose` the lm_head's bf16 logits uncast (one launch fewer): greedy DFlash
    and DSpark blocks and sampled q must be those of the logits' fp32 cast."""
    _, draft = load(ckpts, threshold=0.5)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 5, V, generator=g) * 4).to(torch.bfloat16)
    hidden, anchor = torch.randn(3, 5, draft.cfg.hidden_size, generator=g), torch.randint(0, V, (3,), generator=g)
    sampling = draft.block_sampling([DraftBlock(1, 8, [0], sampling=DraftSampling(0.7, 0, 0.9, 0.0, 3))] * 3, 5,
                                    torch.device("cpu"))
    for markov in (None, draft.markov_head):
        for s in (None, sampling):
            a = choose_block(logits, anchor, hidden, markov, draft.confidence_head, 0.5, s)
            b = choose_block(logits.float(), anchor, hidden, markov, draft.confidence_head, 0.5, s)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.keep, b.keep)
            assert (a.probs is None) == (s is None) and (s is None or torch.equal(a.probs, b.probs))


def ref_filter(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Top-k, then top-p (the smallest prefix of the top-k's distribution reaching p; the top token
    always kept), then min-p, on one row, by a loop over the sorted tokens."""
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))[: top_k if top_k > 0 else len(x)]
    p = torch.softmax(x[order], 0)
    kept, mass = [], 0.0
    for j, i in enumerate(order):
        if kept and top_p < 1 and mass >= top_p:
            break
        kept.append(i)
        mass += float(p[j])
    out = torch.full_like(x, float("-inf"))
    out[kept] = x[kept]
    if min_p > 0:
        q = torch.softmax(out, 0)
        out = torch.where(q < q.max() * min_p, float("-inf"), out)
    return out


def test_inverse_cdf_skips_zero_mass_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 0.9999999999], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]

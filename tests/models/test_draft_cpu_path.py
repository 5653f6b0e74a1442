"""The draft's CPU drafting path (models/draft.py `_layers_fused`, `_logits_cpu`: fused products on
transposed weight copies, the context gathered once per forward) against the modules' own forward
on random weights and a pool that is NaN wherever no request sees, and its weight cache following
a weight changed in place; its bf16 products (`cpu_bf16`) for greedy blocks."""

from __future__ import annotations

import pytest
import torch

from glm53.models import DFlashConfig, DFlashDraft, DraftBlock, GlmConfig, GlmForCausalLM, KVPools, add_draft_pools
from glm53.models.draft_weights import load_draft_weights
from glm53.models.weights import load_weights
from tests.models.draft_oracle import target_and_draft

PAGE, PAGES = 4, 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_cpu")
    target_and_draft(root, seed=51)
    tcfg = GlmConfig.from_dir(root / "target")
    target = GlmForCausalLM(tcfg)
    load_weights(target, root / "target", progress=False)
    draft = DFlashDraft(DFlashConfig.from_dir(root / "draft", tcfg), tcfg)
    load_draft_weights(draft, root / "draft")
    return target, draft


def module_path(draft: DFlashDraft, target, blocks, pools):
    """draft_block's hidden and logits through the modules (DraftLayer.forward, the lm_head)."""
    fused, logits_cpu = draft._fused_weights, draft._logits_cpu
    draft._fused_weights = lambda dtype=None: None
    draft._logits_cpu = lambda t, h, products=None: DFlashDraft.logits_of(t, h)
    try:
        return draft.draft_block(target, blocks, pools)[1]
    finally:
        draft._fused_weights, draft._logits_cpu = fused, logits_cpu


def setup_pools(draft: DFlashDraft, g: torch.Generator):
    pools = KVPools(PAGES, PAGE)
    pool = add_draft_pools(pools, draft)
    pool.tensor.fill_(float("nan"))  # nothing written is ever visible
    written = [13, 6, 21]
    pages = [list(range(i * 9 + 1, i * 9 + 1 + -(-(n + 8) // PAGE)))[::-1] for i, n in enumerate(written)]
    for n, pg in zip(written, pages):
        c = draft.context(torch.randn(n, draft.cfg.hidden_size, generator=g))
        slots = torch.tensor([pg[p // PAGE] * PAGE + p % PAGE for p in range(n)])
        draft.write_context(c, torch.arange(n), slots, pools)
    # request 0 attends from position 3 on (ctx_start), request 2 has its last 2 positions not yet visible
    return pools, [DraftBlock(7, 13, pages[0], 3), DraftBlock(11, 6, pages[1]), DraftBlock(5, 19, pages[2])]


@pytest.mark.parametrize("block", [3, 6])
def test_cpu_path_matches_the_modules(models, block):
    target, draft = models
    g = torch.Generator().manual_seed(block)
    pools, blocks = setup_pools(draft, g)
    for b in blocks:
        b.block_size = block
    assert draft._fused_weights() is not None
    choice, logits = draft.draft_block(target, blocks, pools)
    want = module_path(draft, target, blocks, pools)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(choice.tokens, want.argmax(dim=-1))
    # one request alone drafts what it drafts in the batch
    alone = draft.draft_block(target, blocks[1:2], pools)[1]
    torch.testing.assert_close(alone[0], logits[1], rtol=1e-5, atol=1e-5)


def test_cpu_path_follows_weights_changed_in_place(models):
    target, draft = models
    pools, blocks = setup_pools(draft, torch.Generator().manual_seed(9))
    before = draft.draft_block(target, blocks, pools)[1]
    saved = [draft.layers[0].self_attn.k_proj.weight.clone(), draft.layers[1].mlp.up_proj.weight.clone(),
             target.lm_head.weight.clone()]
    try:
        draft.layers[0].self_attn.k_proj.weight.mul_(1.5)
        draft.layers[1].mlp.up_proj.weight.mul_(-1)
        target.lm_head.weight.mul_(0.5)
        after = draft.draft_block(target, blocks, pools)[1]
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, module_path(draft, target, blocks, pools), rtol=1e-5, atol=1e-5)
    finally:
        draft.layers[0].self_attn.k_proj.weight.copy_(saved[0])
        draft.layers[1].mlp.up_proj.weight.copy_(saved[1])
        target.lm_head.weight.copy_(saved[2])


def test_bf16_products_for_greedy_blocks_only(models):
    """`cpu_bf16`: greedy blocks multiply bf16 copies of the weights (near the fp32 logits, not
    equal to them); a batch with a sampled row keeps the fp32 products bit for bit."""
    from glm53.models.draft import DraftSampling

    target, draft = models
    pools, blocks = setup_pools(draft, torch.Generator().manual_seed(4))
    for b in blocks:
        b.block_size = 5
    want = draft.draft_block(target, blocks, pools)[1]
    draft.cpu_bf16 = True
    try:
        got = draft.draft_block(target, blocks, pools)[1]
        assert draft._fused_weights(torch.bfloat16)[0].qkv.dtype == torch.bfloat16
        assert not torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())
        blocks[1].sampling = DraftSampling(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=3)
        torch.testing.assert_close(draft.draft_block(target, blocks, pools)[1], want, rtol=0, atol=0)
    finally:
        draft.cpu_bf16 = False


def test_bf16_context_kv_product(models):
    """`cpu_bf16`: `write_context` multiplies the context rows by a bf16 copy of the stacked K/V
    weights (every row, greedy or sampled: the KV serves both); the K it stores is still normed
    and rotated in fp32, so it is near the fp32 one, and it follows a weight changed in place."""
    _, draft = models
    g = torch.Generator().manual_seed(21)
    c = draft.context(torch.randn(37, draft.cfg.hidden_size, generator=g))
    slots = torch.randperm(PAGES * PAGE, generator=g)[:37]

    def written() -> torch.Tensor:
        pools = KVPools(PAGES, PAGE)
        add_draft_pools(pools, draft)
        draft.write_context(c, torch.arange(5, 42), slots, pools)
        return draft._all_layers(pools["draft_kv"])[slots // PAGE, slots % PAGE].clone()

    want = written()
    draft.cpu_bf16 = True
    k = draft.layers[1].self_attn.k_proj.weight
    saved = k.clone()
    try:
        got = written()
        assert draft._stacked_kv_t(torch.bfloat16).dtype == torch.bfloat16
        assert torch.isfinite(got).all() and not torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())
        k.mul_(-1)
        draft.cpu_bf16 = False
        want = written()
        draft.cpu_bf16 = True
        torch.testing.assert_close(written(), want, rtol=0, atol=0.03 * want.abs().max().item())
    finally:
        k.copy_(saved)
        draft.cpu_bf16 = False

"""The CPU speculative step's shortcuts (issue 31) against the forms they replace, bit for bit,
on fresh random inputs: the draft context write (`DFlashDraft.write_context`: `_rms` and the
half-split RoPE table instead of the reference norm and rotation), the context norm and the
drafting forward's final norm (`_rms`), the host-built block context (`_context_pages` with the
block's own slots) and a verify forward's logits without the row gather (every row of an
`all_logits` chunk)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53.kernels.norm import rms_norm, rms_norm_reference
from glm53.kernels.rope import apply_rope, rope_cos_sin
from glm53.models import (
    DFlashConfig, DFlashDraft, DraftBlock, GlmConfig, KVPools, ModelRunner, SeqChunk, add_draft_pools,
)
from glm53.models.draft import DRAFT_KV, _rms, _rope_half
from glm53.models.draft_weights import load_draft_weights
from tests.models.draft_oracle import target_and_draft

PAGE, PAGES = 4, 48


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return target_and_draft(tmp_path_factory.mktemp("spec_cpu"), seed=61)


@pytest.fixture(scope="module")
def draft(ckpts):
    tcfg = GlmConfig.from_dir(ckpts[0])
    d = DFlashDraft(DFlashConfig.from_dir(ckpts[1], tcfg), tcfg)
    load_draft_weights(d, ckpts[1])
    return d


def old_write_context(d: DFlashDraft, c, positions, out_slots, pools) -> None:
    """`write_context` as it was: the reference norm (kernels/norm) and rotation (kernels/rope)."""
    pool = pools[DRAFT_KV]
    n, nl, kv, hd = c.shape[0], len(d.layers), d.kv_heads_local, d.cfg.head_dim
    cos, sin = rope_cos_sin(positions, d.inv_freq)
    w_kv, w_norm = d._stacked_kv()
    x = F.linear(c, w_kv).view(n, nl, 2, kv, hd)
    k = rms_norm(x[:, :, 0], w_norm, d.cfg.rms_norm_eps)
    k = apply_rope(k.reshape(n, nl * kv, hd), cos, sin, interleave=False).view(n, nl, kv, hd)
    vals = torch.stack([k, x[:, :, 1]], dim=3).permute(0, 2, 3, 1, 4).reshape(n, 2 * kv, nl, hd)
    ps = pools.page_size
    d._all_layers(pool)[out_slots // ps, out_slots % ps] = vals.to(pool.dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_write_context_equals_the_reference_form(draft, seed):
    g = torch.Generator().manual_seed(seed)
    n = [1, 8, 37][seed]
    acc = torch.randn(n, draft.cfg.hidden_size, generator=g) * 3
    positions = torch.randint(0, 4000, (n,), generator=g)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:n]
    got, want = KVPools(PAGES, PAGE), KVPools(PAGES, PAGE)
    for pools in (got, want):
        add_draft_pools(pools, draft).tensor.fill_(float("nan"))
    c = draft.context(acc)
    assert torch.equal(c, rms_norm_reference(acc, draft.hidden_norm.weight, draft.cfg.rms_norm_eps))
    draft.write_context(c, positions, slots, got)
    old_write_context(draft, c, positions, slots, want)
    assert torch.equal(got[DRAFT_KV].tensor.nan_to_num(7.0), want[DRAFT_KV].tensor.nan_to_num(7.0))
    assert torch.isfinite(got[DRAFT_KV].tensor.flatten(1)[:, :1]).sum() > 0


def test_cpu_norm_and_rotation_are_the_references():
    g = torch.Generator().manual_seed(5)
    for shape in [(1, 64), (8, 64), (13, 6, 32), (9, 3, 2, 16)]:
        x = torch.randn(shape, generator=g) * 4
        w = torch.randn(shape[-1], generator=g)
        assert torch.equal(_rms(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
        assert torch.equal(_rms(x, None, 1e-6) * w, rms_norm_reference(x, w, 1e-6))
    x = torch.randn(11, 5, 32, generator=g)
    cos, sin = rope_cos_sin(torch.randint(0, 8000, (11,), generator=g), 1.0 / (1e4 ** (torch.arange(0, 32, 2) / 32)))
    assert torch.equal(_rope_half(x, cos, sin), apply_rope(x, cos, sin, interleave=False))


def old_context_pages(blocks, page_size):
    """`_context_pages` as it was (no block slots)."""
    first = min(blk.ctx_start for blk in blocks) // page_size
    width = max(1, -(-max(blk.start_pos for blk in blocks) // page_size) - first)
    table = torch.zeros(len(blocks), width, dtype=torch.long)
    for i, blk in enumerate(blocks):
        row = blk.page_table[first : first + width]
        table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    pos = first * page_size + torch.arange(width * page_size)
    ctx_start = torch.tensor([blk.ctx_start for blk in blocks])[:, None]
    start = torch.tensor([blk.start_pos for blk in blocks])[:, None]
    return table, (pos[None] >= ctx_start) & (pos[None] < start)


@pytest.mark.parametrize("seed", range(6))
def test_context_pages_equal_the_old_table_and_mask(seed):
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(int(torch.randint(1, 5, (), generator=g))):
        start = int(torch.randint(0, 60, (), generator=g))
        ctx = int(torch.randint(0, start + 1, (), generator=g)) if seed % 2 else 0
        pages = torch.randperm(40, generator=g)[: -(-(start + 9) // PAGE)].tolist()
        blocks.append(DraftBlock(3, start, pages, ctx))
    block = int(torch.randint(2, 17, (), generator=g))
    table, mask = DFlashDraft._context_pages(blocks, PAGE, block)
    want_table, want_mask = old_context_pages(blocks, PAGE)
    assert torch.equal(table, want_table)
    assert torch.equal(mask, torch.cat([want_mask, want_mask.new_ones(len(blocks), block)], dim=1))
    assert torch.equal(DFlashDraft._context_pages(blocks, PAGE)[1], want_mask)


def test_verify_logits_are_every_rows_logits(ckpts):
    """A forward of all_logits chunks (no row gather) gives the logits of every row, as the
    gathered rows of the same forward do."""
    r = ModelRunner.from_dir(ckpts[0], page_size=PAGE, num_pages=PAGES, progress=False, draft_dir=ckpts[1])
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 160, (21,), generator=g).tolist()
    pages = list(range(10, 10 + -(-(21 + 8) // PAGE)))
    r.forward([SeqChunk(prompt, 0, pages)])
    block = torch.randint(0, 160, (6,), generator=g).tolist()
    chunk = SeqChunk(block, 21, pages, all_logits=True)
    captured = {}
    head_of = r.model.head  # the lm_head of final-normed rows
    r.model.head = lambda hn: captured.setdefault("hn", hn.clone()) is not None and head_of(hn)
    try:
        got = r.forward([chunk])[0]
    finally:
        r.model.head = head_of
    rows = torch.tensor(ModelRunner.logit_rows([chunk]))
    assert torch.equal(got, head_of(captured["hn"][rows]))
    assert got.shape == (6, r.cfg.vocab_size)

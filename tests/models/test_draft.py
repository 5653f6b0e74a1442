"""The DFlash draft on its own: config loading and validation, the partial-projection identity,
drafting against the plain-torch reference (paged context on scattered pages, ctx_start > 0,
ragged batched requests), the draft_kv pool layout and its registration with the transfer
layer, the loader's errors and the random-checkpoint writer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm53.models import (
    DRAFT_KV, ConfigError, DFlashConfig, DFlashDraft, DraftBlock, DraftProjection, GlmConfig, GlmForCausalLM, KVPools,
    ModelRunner, PageAllocator, WeightError, add_draft_pools, build_target_layer_ids, check_draft_tp, draft_kv_bytes_per_token,
    load_draft_projection, load_draft_weights, write_random_draft,
)
from glm53.models.draft_checkpoint import draft_config_dict
from glm53.models.weights import load_weights
from glm53.support.oracle import BASE, make_checkpoint
from glm53.transport.buffers import BufferSpec, Heads, Replicated
from tests.models.draft_oracle import RefDraft, make_draft_checkpoint

SCHEDULE = dict(index_topk_freq=2, index_skip_topk_offset=2)  # F F S F S
IDS = [1, 2, 4]  # 4 is the target's last layer: its feature is taken after the final norm
PAGE, PAGES = 4, 48


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    make_checkpoint(root / "target", seed=41, **SCHEDULE)
    ref = make_draft_checkpoint(root / "draft", root / "target", seed=42, target_layer_ids=IDS)
    return root / "target", root / "draft", ref


def load(ckpts, tp=None) -> tuple[GlmForCausalLM, DFlashDraft]:
    target_dir, draft_dir, _ = ckpts
    tcfg = GlmConfig.from_dir(target_dir)
    target = GlmForCausalLM(tcfg, tp=tp)
    load_weights(target, target_dir, progress=False)
    draft = DFlashDraft(DFlashConfig.from_dir(draft_dir, tcfg), tcfg, tp=tp)
    load_draft_weights(draft, draft_dir)
    return target, draft


def scattered_pages(lengths: list[int]) -> list[list[int]]:
    alloc = PageAllocator(PAGES)
    held = [alloc.alloc(1) for _ in range(20)]
    for h in held[::2]:
        alloc.free(h)
    return [alloc.alloc(-(-n // PAGE)) for n in lengths]


# --- config ---

def test_default_target_layer_ids_match_the_published_drafts():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B draft
    assert build_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]  # Qwen2.5-0.5B draft
    assert build_target_layer_ids(5, 1) == [2]


def test_default_target_layer_ids_on_shallow_targets_stay_distinct():
    # The published spread [1, L - 3] repeats or reverses layers when L < n + 3 ([1, 0] for a
    # 2-layer draft of a 3-layer target); such targets get n layers spread over [0, L).
    assert build_target_layer_ids(3, 2) == [0, 2]
    assert build_target_layer_ids(4, 3) == [0, 2, 3]
    for L in range(1, 12):
        for n in range(1, L + 1):
            ids = build_target_layer_ids(L, n)
            assert len(ids) == n and all(0 <= i < L for i in ids) and ids == sorted(set(ids)), (L, n, ids)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        build_target_layer_ids(2, 3)


def test_config_reads_the_published_layout():
    target = GlmConfig.from_dict(BASE)
    d = draft_config_dict(target, n_layers=2, num_kv_heads=2, head_dim=16, intermediate_size=48, block_size=8)
    cfg = DFlashConfig.from_dict(d, target)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (8, (1, 2), 159)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    # block_size inside dflash_config wins; absent everywhere it is 16; ids default to the spread.
    d2 = {**d, "dflash_config": {"mask_token_id": 3, "block_size": 6}}
    assert DFlashConfig.from_dict(d2, target).block_size == 6
    d3 = {k: v for k, v in d.items() if k != "block_size"}
    d3["dflash_config"] = {"mask_token_id": 3}
    cfg3 = DFlashConfig.from_dict(d3, target)
    assert (cfg3.block_size, cfg3.target_layer_ids) == (16, (1, 2))
    assert DFlashConfig.from_dict({**d3, "num_hidden_layers": 1}, target).target_layer_ids == (2,)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": 32}, "hidden_size: the draft's 32 differs from the target's 64"),
        ({"dflash_config": {"mask_token_id": 160}}, r"dflash_config.mask_token_id: .*\[0, 160\), got 160"),
        ({"dflash_config": {}}, "dflash_config.mask_token_id: required"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 5]}}, r"target_layer_ids: \[5\] outside"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [2, 2]}}, "target_layer_ids: must be strictly"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [-1]}}, r"target_layer_ids: \[-1\] outside"),
        ({"num_key_value_heads": 3}, "num_key_value_heads: 3 does not divide num_attention_heads=4"),
        ({"num_target_layers": 36}, "num_target_layers: the draft was built for 36"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"head_dim": 15}, "head_dim: RoPE needs an even head_dim"),
        ({"intermediate_size": None}, "intermediate_size: required"),
        ({"block_size": 1}, "block_size: must be >= 2"),
    ],
)
def test_config_errors_name_the_field(change, field):
    target = GlmConfig.from_dict(BASE)
    d = {**draft_config_dict(target, n_layers=2, num_kv_heads=2, head_dim=16, intermediate_size=48), **change}
    with pytest.raises(ConfigError, match=field):
        DFlashConfig.from_dict(d, target)


def test_check_draft_tp_names_the_field():
    target = GlmConfig.from_dict(BASE)
    cfg = DFlashConfig.from_dict(draft_config_dict(target, num_kv_heads=2, head_dim=16, intermediate_size=48), target)
    check_draft_tp(cfg, 2)
    with pytest.raises(ConfigError, match="draft num_key_value_heads: 2 is not divisible by tensor_parallel_size=4"):
        check_draft_tp(cfg, 4)
    cfg6 = DFlashConfig.from_dict(draft_config_dict(target, head_dim=16, intermediate_size=50), target)
    with pytest.raises(ConfigError, match="draft intermediate_size: 50 is not divisible by tensor_parallel_size=4"):
        check_draft_tp(cfg6, 4)


# --- context projection ---

def test_partial_projections_sum_to_the_full_projection(ckpts):
    _, draft = load(ckpts)
    _, draft_dir, ref = ckpts
    g = torch.Generator().manual_seed(5)
    h = {i: torch.randn(13, 64, generator=g) for i in IDS}
    want = ref.context(h)  # hidden_norm(fc(concat)) in one GEMM
    one = draft.partial_projection(h)
    assert one.dtype == torch.float32 and one.shape == (13, 64)
    torch.testing.assert_close(draft.context(one), want, rtol=1e-5, atol=1e-5)
    # Any split of the ids over stages, summed in stage order, gives the same bits.
    for split in ([[1], [2, 4]], [[1, 2], [4]], [[1], [2], [4]]):
        acc = None
        for part in split:
            acc = draft.partial_projection({i: h[i] for i in part}, acc)
        assert torch.equal(acc, one), split
    # Normalising per stage is not the same thing.
    per_stage = draft.context(draft.partial_projection({1: h[1]})) + draft.context(draft.partial_projection({2: h[2], 4: h[4]}))
    assert not torch.allclose(per_stage, want, atol=1e-2)
    # A stage's projection (fc's column blocks of its layers) adds the same partial sum.
    first = DraftProjection.of_draft(draft, range(0, 2))
    loaded = load_draft_projection(draft_dir, draft.target_cfg, range(0, 2))
    assert first.ids == loaded.ids == (1,) and torch.equal(first.weight, loaded.weight)
    mid = load_draft_projection(draft_dir, draft.target_cfg, range(2, 4))
    acc = mid.partial_projection({2: h[2]}, first.partial_projection({1: h[1]}))
    assert torch.equal(draft.partial_projection({4: h[4]}, acc), one)
    with pytest.raises(ValueError, match=r"captured layers \[3\] are not draft features"):
        draft.partial_projection({3: h[1]})


# --- drafting against the reference ---

@pytest.mark.parametrize("block", [4, 6])
def test_propose_matches_the_reference(ckpts, block):
    target, draft = load(ckpts)
    ref: RefDraft = ckpts[2]
    pools = KVPools(PAGES, PAGE)
    pool = add_draft_pools(pools, draft)
    g = torch.Generator().manual_seed(7)
    # Written lengths, then where each block starts and from where its context is visible: request
    # 0 has draft KV written past its start (a rejected verify tail), request 2 lacks its first 5.
    written, starts, ctx_starts = [11, 6, 17], [8, 6, 17], [0, 0, 5]
    pages = scattered_pages([n + block for n in written])
    feats = [{i: torch.randn(n, 64, generator=g) for i in IDS} for n in written]
    positions = torch.cat([torch.arange(n) for n in written])
    slots = torch.cat([torch.tensor([pg[p // PAGE] * PAGE + p % PAGE for p in range(n)]) for n, pg in zip(written, pages)])
    batched = {i: torch.cat([f[i] for f in feats]) for i in IDS}
    draft.write_context(draft.context(draft.partial_projection(batched)), positions, slots, pools)

    last = torch.randint(0, 160, (3,), generator=g).tolist()
    blocks = [DraftBlock(t, s, pg, c, block) for t, s, pg, c in zip(last, starts, pages, ctx_starts)]
    tokens, logits = draft.propose(target, blocks, pools, return_logits=True)
    assert tokens.shape == (3, block - 1) and tokens.dtype == torch.long
    for r in range(3):
        kv = ref.context_kv(ref.context(feats[r]), torch.arange(written[r]))
        # The pool's layout: K and V of KV head j at heads 2j and 2j + 1 of [page, heads, layer, offset].
        for layer, (k, v) in enumerate(kv):
            for p in range(written[r]):
                page, off = pages[r][p // PAGE], p % PAGE
                torch.testing.assert_close(pool.tensor[page, 0::2, layer, off], k[p], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(pool.tensor[page, 1::2, layer, off], v[p], rtol=1e-5, atol=1e-5)
        visible = [(k[ctx_starts[r] : starts[r]], v[ctx_starts[r] : starts[r]]) for k, v in kv]
        want_tokens, want_logits = ref.propose(visible, last[r], starts[r], block)
        torch.testing.assert_close(logits[r], want_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(tokens[r], want_tokens)
    # One request alone drafts the same as in the batch (padding and masks do not leak).
    alone = draft.propose(target, blocks[2:], pools, return_logits=True)[1]
    torch.testing.assert_close(alone[0], logits[2], rtol=1e-5, atol=1e-5)


def test_propose_checks_its_blocks(ckpts):
    target, draft = load(ckpts)
    pools = KVPools(PAGES, PAGE)
    add_draft_pools(pools, draft)
    with pytest.raises(ValueError, match="same block_size"):
        draft.propose(target, [DraftBlock(1, 4, [0], block_size=4), DraftBlock(1, 4, [1], block_size=5)], pools)
    with pytest.raises(ValueError, match="page table of 1 pages cannot hold 5 context tokens"):
        draft.propose(target, [DraftBlock(1, 5, [0])], pools)
    with pytest.raises(ValueError, match="ctx_start 5 must lie in"):
        draft.propose(target, [DraftBlock(1, 4, [0], ctx_start=5)], pools)
    assert draft.propose(target, [DraftBlock(1, 0, [])], pools).shape == (1, 3)  # no context at all


# --- pools and their registration ---

def test_pools_register_with_the_transfer_layer(ckpts):
    target_dir, draft_dir, _ = ckpts
    runner = ModelRunner.from_dir(target_dir, page_size=PAGE, num_pages=PAGES, progress=False, draft_dir=draft_dir)
    assert [name for name, _ in runner.pools] == ["latent", "index_k", DRAFT_KV]
    for name, p in runner.pools:
        spec = BufferSpec.for_tensor(name, p.tensor, layers=p.layers, total_heads=p.total_heads)
        assert spec.item_bytes == p.bytes_per_page()
        assert isinstance(spec.shard, Heads if name == DRAFT_KV else Replicated)
    p = runner.pools[DRAFT_KV]
    spec = BufferSpec.for_tensor(DRAFT_KV, p.tensor, layers=p.layers, total_heads=p.total_heads)
    assert p.layers == (0, 1) and p.tensor.shape == (PAGES, 4, 2, PAGE, 16)
    assert spec.shard == Heads(total=4, per_rank=4, bytes_per_head=16 * 4)
    assert spec.bytes_per_token * 2 == runner.draft.kv_bytes_per_token()  # per layer vs all layers
    assert draft_kv_bytes_per_token(runner.draft.cfg, torch.float32, 2) * 2 == runner.draft.kv_bytes_per_token()
    # The per-layer view is [pages, page_size, heads, head_dim], like a replicated pool's.
    assert p.view(1).shape == (PAGES, PAGE, 4, 16) and p.view(1).data_ptr() == p.tensor[:, :, 1].data_ptr()
    # Under tp=2 the transfer layer gives rank r heads [2r, 2r + 2): K and V of KV head r.
    assert [Heads(4, 2, 64).head_range(2, r) for r in range(2)] == [(0, 2), (2, 4)]


def test_head_sharded_pool_validation():
    pools = KVPools(4, 2)
    with pytest.raises(ValueError, match="heads_local dividing total_heads=4"):
        pools.add("x", [0], (3, 8), torch.float32, total_heads=4)
    p = pools.add("y", [0, 1], (2, 8), torch.float32, total_heads=4)
    assert p.head_sharded and p.tensor.shape == (4, 2, 2, 2, 8)
    assert not pools.add("z", [0], (8,), torch.float32).head_sharded


# --- loader and writer ---

def test_loader_accepts_the_model_prefix_and_names_bad_tensors(ckpts, tmp_path):
    target_dir, draft_dir, _ = ckpts
    _, draft = load(ckpts)
    sd = load_file(str(draft_dir / "model.safetensors"))
    cfg_text = (draft_dir / "config.json").read_text()

    def write(tensors, name):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(cfg_text)
        save_file(tensors, str(d / "model.safetensors"))
        return d

    other = DFlashDraft(draft.cfg, draft.target_cfg)
    load_draft_weights(other, write({f"model.{k}": v for k, v in sd.items()}, "prefixed"))
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), draft.parameters()))
    missing = {k: v for k, v in sd.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(WeightError, match="missing from the draft checkpoint: layers.1.mlp.up_proj.weight"):
        load_draft_weights(other, write(missing, "missing"))
    with pytest.raises(WeightError, match="unexpected tensors in the draft checkpoint: embed_tokens.weight"):
        load_draft_weights(other, write({**sd, "embed_tokens.weight": torch.zeros(160, 64)}, "extra"))
    with pytest.raises(WeightError, match=r"fc.weight: shape \(64, 128\) in the draft checkpoint"):
        load_draft_weights(other, write({**sd, "fc.weight": torch.zeros(64, 128)}, "shape"))
    with pytest.raises(WeightError, match="name the same tensor"):
        load_draft_weights(other, write({**sd, "model.norm.weight": sd["norm.weight"].clone()}, "twice"))


def test_writer_is_deterministic_and_fits_its_target(ckpts, tmp_path):
    target_dir = ckpts[0]
    a = write_random_draft(tmp_path / "a", target_dir, seed=3, n_layers=2)
    b = write_random_draft(tmp_path / "b", target_dir, seed=3, n_layers=2)
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == build_target_layer_ids(5, 2) == [1, 2]
    assert all(v.dtype == torch.bfloat16 for v in sa.values())
    runner = ModelRunner.from_dir(target_dir, page_size=PAGE, num_pages=PAGES, progress=False, draft_dir=a)
    assert runner.draft.cfg.num_hidden_layers == 2 and runner.draft.cfg.num_key_value_heads == 4
    # The published spread would repeat ids on a target this shallow ([1, 2, 2]): the whole depth instead.
    assert build_target_layer_ids(5, 3) == [0, 2, 4]
    c = write_random_draft(tmp_path / "c", target_dir, n_layers=3)
    assert ModelRunner.from_dir(target_dir, page_size=PAGE, num_pages=PAGES, progress=False,
                                draft_dir=c).draft.cfg.target_layer_ids == (0, 2, 4)
    with pytest.raises(ConfigError, match="target_layer_ids: must be strictly increasing"):
        write_random_draft(tmp_path / "d", target_dir, n_layers=2, target_layer_ids=[2, 1])

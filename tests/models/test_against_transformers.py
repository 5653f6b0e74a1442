"""The model core against transformers' GlmMoeDsaForCausalLM on tiny random checkpoints, with
contexts 3-10x index_topk so that DSA sparsity is real."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk
from glm53.server.offline import greedy_generate
from glm53.support.oracle import make_checkpoint
from tests.models.oracle_compare import TOPK, IndexGapProbe, random_config, rel_err, stable_topk

SCHEDULES = [
    dict(index_topk_freq=1, index_skip_topk_offset=2, first_k_dense_replace=1, n_group=2, topk_group=1),
    dict(index_topk_freq=2, index_skip_topk_offset=2, first_k_dense_replace=0, n_group=1, topk_group=1),
    dict(index_topk_freq=3, index_skip_topk_offset=1, first_k_dense_replace=2, n_group=4, topk_group=2),
    dict(index_topk_freq=4, index_skip_topk_offset=3, first_k_dense_replace=3, n_group=2, topk_group=2),
    dict(index_topk_pattern="FSFFS", first_k_dense_replace=1, n_group=2, topk_group=1),
]


@pytest.mark.parametrize("sched", SCHEDULES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_prefill_logits_match_transformers(tmp_path, monkeypatch, sched):
    ref = make_checkpoint(tmp_path, seed=1, **sched)
    probe = IndexGapProbe(monkeypatch, TOPK)
    runner = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=128, progress=False)
    allocator = PageAllocator(128)
    assert "shared" in runner.cfg.indexer_types or sched.get("index_topk_freq") == 1
    g = torch.Generator().manual_seed(7)
    lengths = [3 * TOPK, 6 * TOPK, 10 * TOPK]
    prompts = [torch.randint(0, 160, (n,), generator=g) for n in lengths]
    chunks = []
    for p in prompts:
        pages = allocator.alloc(runner.pages_needed(len(p)))
        random.Random(len(p)).shuffle(pages)
        chunks.append(SeqChunk(p.tolist(), 0, pages, all_logits=True))
    ours = runner.forward(chunks)  # all three sequences in one batch
    for p, out in zip(prompts, ours):
        with torch.no_grad():
            want = ref(p[None]).logits[0]
        assert rel_err(out, want) <= 1e-4
    probe.assert_well_posed()


# Config fields GLM-5 itself leaves at one value but other family checkpoints set: unnormalized
# top-k routing weights, tied embeddings, an explicit dense/sparse MLP pattern (not a prefix),
# several shared experts, no routed scaling, other latent and head widths.
VARIANTS = [
    dict(norm_topk_prob=False, tie_word_embeddings=True,
         mlp_layer_types=["sparse", "dense", "sparse", "dense", "sparse"], n_shared_experts=2, routed_scaling_factor=1.0, index_topk_freq=2, index_skip_topk_offset=1),
    dict(norm_topk_prob=False, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=48, q_lora_rank=16,
         qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=8, n_routed_experts=16, n_group=4, topk_group=2,
         num_experts_per_tok=3, index_head_dim=16, index_n_heads=32, rms_norm_eps=1e-6,
         indexer_types=["full", "shared", "full", "full", "shared"]),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=["norm-off-tied-pattern", "widths-groups"])
def test_config_variants_match_transformers(tmp_path, monkeypatch, variant):
    ref = make_checkpoint(tmp_path, seed=11, **variant)
    probe = IndexGapProbe(monkeypatch, TOPK)
    runner = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=128, progress=False)
    allocator = PageAllocator(128)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 160, (n,), generator=g) for n in (5, 4 * TOPK, 7 * TOPK)]
    chunks = [SeqChunk(p.tolist(), 0, allocator.alloc(runner.pages_needed(len(p))), all_logits=True) for p in prompts]
    for p, out in zip(prompts, runner.forward(chunks)):
        with torch.no_grad():
            want = ref(p[None]).logits[0]
        assert rel_err(out, want) <= 1e-4
    probe.assert_well_posed()


# Widths no other test uses, from a random sweep of 100 configs (benchmarks/history/2026-12-05.md,
# twenty-eighth session): 3 and 6 heads, rope 4, v wider than nope, kv_lora 40, 8 index heads and
# 32 of 64 wide, 16 experts in 4 groups, no dense prefix, index sharing every 2-4 layers, pages of 1
# and 16 tokens. Each seed is one whose index scores have no near-tie at the k-th place (the probe).
ODD = [
    (13, 16, dict(num_hidden_layers=4, hidden_size=48, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=24,
                  q_lora_rank=48, qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=16, index_head_dim=16,
                  n_routed_experts=4, moe_intermediate_size=48, first_k_dense_replace=0, routed_scaling_factor=1.0,
                  n_shared_experts=2, n_group=2, topk_group=2, num_experts_per_tok=4, index_topk_freq=2,
                  index_skip_topk_offset=3)),
    (101, 1, dict(num_hidden_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=32,
                  q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=16, index_head_dim=64,
                  index_n_heads=32, n_routed_experts=4, first_k_dense_replace=0, routed_scaling_factor=1.0,
                  n_group=1, num_experts_per_tok=3, rms_norm_eps=1e-6)),
    (100, 4, dict(num_hidden_layers=5, hidden_size=80, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=40,
                  q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=40, index_head_dim=16,
                  index_n_heads=8, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=2,
                  first_k_dense_replace=0, n_shared_experts=2, index_topk_freq=4, index_skip_topk_offset=3,
                  rope_parameters={"rope_theta": 1e6, "rope_type": "default"})),
]


@pytest.mark.parametrize("seed,page,widths", ODD, ids=["3-heads", "6-heads", "16-experts"])
def test_odd_widths_match_transformers(tmp_path, monkeypatch, seed, page, widths):
    ref = make_checkpoint(tmp_path, seed=seed, **widths)
    probe = IndexGapProbe(monkeypatch, TOPK)
    runner = ModelRunner.from_dir(tmp_path, page_size=page, num_pages=1024, progress=False)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 158, (n,), generator=g).tolist() for n in (TOPK - 3, 4 * TOPK + 1, 9 * TOPK)]
    _assert_oracle_agrees(ref, prompts, *_prefill_and_greedy(runner, prompts, 8, 1024), 8)
    probe.assert_well_posed()


# Random configs (`random_config`) from tools/oracle_sweep.py's sweep of seeds 5000-5199 (2026-12-08,
# at b8564ef: 199 agreed; the one mismatch, 5061, had exactly tied index scores at the k-th
# place, where fp32 rounding at ReLU's kink decides the oracle's order): the first 16 whose index
# scores have no near-tie at the k-th place, so the comparison is well posed on any CPU.
SWEEP_SEEDS = [5002, 5006, 5008, 5009, 5010, 5013, 5014, 5017, 5018, 5020, 5021, 5022, 5025, 5027, 5028, 5031]


def sweep_case(seed: int, steps: int = 8) -> tuple[bool, float, IndexGapProbe, dict, int]:
    """A random config, page size and prompt lengths (`random_config`) from `seed`: ours prefills
    the prompts in one batch and decodes `steps` greedy tokens each; the oracle (its exact ties
    broken as ours, `stable_topk`) must give prefill logits within 1e-4 and its argmax along our
    tokens must be them. -> (agrees, max relative error of the logits, the index-gap probe,
    config, page size)."""
    cfg, page, lengths = random_config(seed)
    mp = pytest.MonkeyPatch()
    try:
        with tempfile.TemporaryDirectory() as d:
            ref = make_checkpoint(Path(d), seed=seed, **cfg)
            probe = IndexGapProbe(mp, cfg["index_topk"])
            runner = ModelRunner.from_dir(Path(d), page_size=page, num_pages=4096 // page, progress=False)
            g = torch.Generator().manual_seed(seed)
            prompts = [torch.randint(0, 158, (m,), generator=g).tolist() for m in lengths]
            logits, outs = _prefill_and_greedy(runner, prompts, steps, 4096 // page)
            with stable_topk(), torch.no_grad():
                errs = [rel_err(out, ref(torch.tensor([p])).logits[0]) for p, out in zip(prompts, logits)]
                greedy = all(o == ref(torch.tensor([p + o])).logits[0][len(p) - 1: len(p) - 1 + steps].argmax(-1).tolist()
                             for p, o in zip(prompts, outs))
    finally:
        mp.undo()
    return max(errs) <= 1e-4 and greedy, max(errs), probe, cfg, page


@pytest.mark.parametrize("seed", SWEEP_SEEDS)
def test_random_configs_match_transformers(seed):
    agrees, err, probe, cfg, page = sweep_case(seed)
    probe.assert_well_posed()
    assert agrees, (err, cfg, page)


def _prefill_and_greedy(runner: ModelRunner, prompts: list[list[int]], steps: int,
                        pages: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Our prefill logits of every prompt row (one batch) and `steps` greedy tokens per prompt."""
    allocator = PageAllocator(pages)
    chunks = [SeqChunk(p, 0, allocator.alloc(runner.pages_needed(len(p) + steps)), all_logits=True) for p in prompts]
    return runner.forward(chunks), greedy_generate(runner, PageAllocator(pages), prompts, steps, ignore_eos=True)


def _assert_oracle_agrees(ref, prompts: list[list[int]], logits: list[torch.Tensor], outs: list[list[int]],
                          steps: int) -> None:
    """The oracle's prefill logits match ours, and its argmax along our greedy tokens is them."""
    for p, out in zip(prompts, logits):
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0]
        assert rel_err(out, want) <= 1e-4
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            got = ref(torch.tensor([p + o])).logits[0]
        assert o == got[len(p) - 1 : len(p) - 1 + steps].argmax(-1).tolist()


# A held-out random config (seed 9279 of the thirty-eighth session's sweep) with 4 index heads:
# on some rows every head's ReLU score is 0, so index scores tie exactly at the k-th place. The
# oracle's top-k orders such ties arbitrarily (13 of 27 sweep configs then differed from it); with
# its ties broken by lowest position, as our contract says, every one agreed to 1e-6.
TIES = dict(num_hidden_layers=4, hidden_size=96, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
            q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, index_head_dim=32, index_n_heads=4,
            n_routed_experts=4, n_group=2, topk_group=2, num_experts_per_tok=3, n_shared_experts=2,
            first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=True, index_topk=TOPK,
            index_topk_freq=3, index_skip_topk_offset=2, moe_intermediate_size=16, rms_norm_eps=1e-5)


def test_exact_index_ties_break_by_lowest_position(tmp_path, monkeypatch):
    ref = make_checkpoint(tmp_path, seed=9279, **TIES)
    probe = IndexGapProbe(monkeypatch, TOPK)
    runner = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=512, progress=False)
    g = torch.Generator().manual_seed(9279)
    prompts = [torch.randint(0, 158, (n,), generator=g).tolist() for n in (TOPK - 1, 4 * TOPK + 1, 9 * TOPK)]
    ours = _prefill_and_greedy(runner, prompts, 12, 512)  # before the patch: it is the oracle's only
    assert probe.rows > 0 and probe.min_ratio == 0, "no exact tie at the k-th place: the test lost its point"
    with stable_topk():
        _assert_oracle_agrees(ref, prompts, *ours, 12)


def test_greedy_decode_matches_transformers_argmax(tmp_path, monkeypatch):
    ref = make_checkpoint(tmp_path, seed=2, index_topk_freq=2, index_skip_topk_offset=2)
    probe = IndexGapProbe(monkeypatch, TOPK)
    runner = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=512, progress=False)
    allocator = PageAllocator(512)
    # Fragment the free list so that every request gets scattered pages.
    held = [allocator.alloc(1) for _ in range(200)]
    for h in held[::2]:
        allocator.free(h)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 158, (n,), generator=g).tolist() for n in (25, 31, 40, 57)]
    steps = 64
    outs = greedy_generate(runner, allocator, prompts, steps, ignore_eos=True)
    for p, o in zip(prompts, outs):
        assert len(o) == steps
        with torch.no_grad():
            logits = ref(torch.tensor([p + o])).logits[0]
        # logits at position len(p)-1+j predict o[j] given the growing sequence p + o[:j].
        want = logits[len(p) - 1 : len(p) - 1 + steps].argmax(-1).tolist()
        assert o == want
    assert allocator.num_free == 512 - 100
    probe.assert_well_posed()


def test_chunked_prefill_equals_one_shot(tmp_path):
    make_checkpoint(tmp_path, seed=3, index_topk_freq=2, index_skip_topk_offset=2)
    runner = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=256, progress=False)
    allocator = PageAllocator(256)
    prompt = torch.randint(0, 160, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    pages = allocator.alloc(runner.pages_needed(len(prompt)))
    one = runner.forward([SeqChunk(prompt, 0, pages, all_logits=True)])[0]
    for chunk in (1, 5, 16, 33):
        pieces = []
        for s in range(0, len(prompt), chunk):
            pieces.append(runner.forward([SeqChunk(prompt[s : s + chunk], s, pages, all_logits=True)])[0])
        assert rel_err(torch.cat(pieces), one) <= 1e-5


def test_verify_step_matches_sequential_decode(tmp_path):
    """q_len > 1 per request (speculative verify) with ragged contexts equals one-token steps."""
    make_checkpoint(tmp_path, seed=4)
    runner = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=256, progress=False)
    allocator = PageAllocator(256)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (20, 45)]
    blocks = [torch.randint(0, 160, (4,), generator=g).tolist() for _ in prompts]
    pages = [allocator.alloc(runner.pages_needed(len(p) + 4)) for p in prompts]
    runner.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)])
    verify = runner.forward(
        [SeqChunk(b, len(p), pg, all_logits=True) for p, b, pg in zip(prompts, blocks, pages)]
    )
    for p, b, pg, v in zip(prompts, blocks, pages, verify):
        seq = [runner.forward([SeqChunk([t], len(p) + j, pg)])[0][0] for j, t in enumerate(b)]
        assert rel_err(v, torch.stack(seq)) <= 1e-5

"""Tensor parallelism on CPU: tp=2 and tp=4 ranks as real processes joined by gloo, each loading
its shard from the same oracle checkpoint (index sharing on, contexts several times index_topk)
and running chunked prefill and batched decode through `ModelRunner`, against tp=1 in the
parent. Ranks sample from rank 0's logits, as the scheduler does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm53.models import ConfigError, GlmConfig, GlmForCausalLM, ModelRunner, check_tp
from glm53.models.weights import checkpoint_tensors, load_weights
from glm53.support.oracle import BASE, make_checkpoint, quantise_fp8_
from tests.models.tp_harness import (
    DECODE_STEPS, PAGE, PAGES, ReadRecorder, checkpoint_rules, greedy, greedy_from_rank0, run_ranks, scenario,
)

SCHEDULE = dict(index_topk_freq=2, index_skip_topk_offset=2)  # F F S F S; layer 0 dense


def _check_reads(model: torch.nn.Module, reads: list[tuple[str, tuple[int, ...], bool]]) -> None:
    """Every checkpoint tensor is read once: split ones as this rank's slice only, replicated
    ones whole; so the bytes read are the replicated bytes plus 1/size of the split ones."""
    tensors = checkpoint_tensors(model)
    rules = checkpoint_rules(model, tensors)
    by_name = {}
    for name, shape, whole in reads:
        assert name not in by_name, f"{name} read twice"
        by_name[name] = (shape, whole)
    assert set(by_name) == set(tensors)
    for name, (full, _) in tensors.items():
        shape, whole = by_name[name]
        rule = rules[name]
        if rule.replicated:
            assert whole and shape == full, name
        else:
            assert not whole and shape == rule.local_shape(full) != full, f"{name}: read {shape} of {full}"


def _rank_main(tp, ckpt: str, out: str) -> None:
    with ReadRecorder() as rec:
        runner = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False, tp=tp)
    _check_reads(runner.model, rec.reads)
    cfg = runner.cfg
    # The shard still lists full checkpoint shapes, in the single-rank order.
    with torch.device("meta"):
        whole = GlmForCausalLM(cfg)
    assert list(checkpoint_tensors(runner.model).items()) == list(checkpoint_tensors(whole).items())
    # The model checks divisibility before building anything.
    odd = GlmConfig.from_dict({**BASE, "num_attention_heads": 3, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match=f"num_attention_heads: 3 is not divisible by tensor_parallel_size={tp.size}"):
        GlmForCausalLM(odd, tp=tp)

    tp.stats.reset()
    res = scenario(runner, greedy_from_rank0(tp))
    stats = dict(vars(tp.stats))
    # Top-k slots gathered from every rank are identical (ties included).
    for t in res["topk"]:
        every = tp.all_gather(t[None], dim=0)
        assert all(torch.equal(every[0], every[r]) for r in range(tp.size))
    torch.save({**res, "stats": stats}, Path(out) / f"rank{tp.rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_tp_ranks_match_single_rank(tmp_path, world):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=31, **SCHEDULE)
    single = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False)
    ref = scenario(single, greedy)
    run_ranks(world, _rank_main, str(ckpt), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    err = max(float((a - b).abs().max()) for a, b in zip(ranks[0]["logits"], ref["logits"]))
    scale = max(float(b.abs().max()) for b in ref["logits"])
    print(f"tp={world}: max |logit error| vs tp=1 = {err:.3g} (max |logit| {scale:.3g})")
    for a, b in zip(ranks[0]["logits"], ref["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for r in ranks:
        assert r["tokens"] == ref["tokens"]
        # Every rank returns the same full fp32 logits, bit for bit.
        assert all(torch.equal(a, b) for a, b in zip(r["logits"], ranks[0]["logits"]))
        assert len(r["topk"]) == len(ref["topk"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(r["topk"], ref["topk"]))

    # Collectives per forward: embedding + attention and MLP of each layer all-reduce, lm_head gathers.
    cfg, forwards = single.cfg, len(ref["tokens"]) - 1 + 4  # decode steps + prefill chunks (56 tokens / 16)
    assert len(ref["tokens"]) - 1 == DECODE_STEPS
    n_tokens = (3 * 8 + 5) + (5 * 8 + 3) + 7 * 8 + 3 * DECODE_STEPS
    st = ranks[0]["stats"]
    assert st["all_reduce_calls"] == forwards * (1 + 2 * cfg.num_hidden_layers)
    assert st["all_reduce_bytes"] == n_tokens * cfg.hidden_size * 4 * (1 + 2 * cfg.num_hidden_layers)
    assert st["all_gather_calls"] == forwards
    assert st["all_gather_bytes"] == n_tokens * cfg.vocab_size // world * 4  # every row gets logits


def _rank_fp8(tp, ckpt: str) -> None:
    cfg = GlmConfig.from_dir(ckpt)
    full = GlmForCausalLM(cfg)
    load_weights(full, ckpt, progress=False)
    shard = GlmForCausalLM(cfg, tp=tp)
    with ReadRecorder() as rec:
        load_weights(shard, ckpt, progress=False)
    weights = [r for r in rec.reads if not r[0].endswith("_scale_inv")]
    _check_reads(shard, weights)
    ref = dict(full.named_parameters())
    for name, p in shard.named_parameters():
        rule, want = p.shard, ref[name]
        if not rule.replicated:
            stacked = p.dim() == 3  # routed experts [E, ...]: the rule indexes one expert's tensor
            idx = rule.index(tuple(want.shape[1:] if stacked else want.shape))
            want = want[(slice(None), *idx)] if stacked else want[idx]
        # Dequantising a slice with its scale blocks equals slicing the dequantised tensor.
        assert torch.equal(p, want), name


def test_tp_fp8_slices_dequantise_like_the_full_tensor(tmp_path):
    make_checkpoint(tmp_path, seed=32, **SCHEDULE)
    # 24-row/column blocks: shard boundaries (e.g. q_b_proj row 64, expert rows 16) fall mid-block.
    quantise_fp8_(tmp_path, block=24)
    run_ranks(2, _rank_fp8, str(tmp_path))


@pytest.mark.parametrize(
    "overrides, tp, field",
    [
        ({}, 3, "num_attention_heads: 4 is not divisible by tensor_parallel_size=3"),
        ({"moe_intermediate_size": 34}, 4, "moe_intermediate_size: 34 is not divisible"),
        ({"intermediate_size": 98}, 4, "intermediate_size: 98 is not divisible"),
        ({"vocab_size": 162}, 4, "vocab_size: 162 is not divisible"),
        ({}, 0, "tensor_parallel_size: must be an integer >= 1"),
    ],
)
def test_check_tp_names_the_dimension(overrides, tp, field):
    with pytest.raises(ConfigError, match=field):
        check_tp(GlmConfig.from_dict({**BASE, **overrides}), tp)


def test_check_tp_only_checks_what_is_split():
    check_tp(GlmConfig.from_dict(BASE), 4)
    check_tp(GlmConfig.from_dict(BASE), 1)
    # No dense layer: intermediate_size is never split.
    check_tp(GlmConfig.from_dict({**BASE, "intermediate_size": 98, "first_k_dense_replace": 0}), 4)
    # The indexer is replicated: its head count need not divide.
    check_tp(GlmConfig.from_dict({**BASE, "index_n_heads": 3}), 4)

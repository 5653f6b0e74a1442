"""Tensor parallelism on CPU: tp=2 and tp=4 ranks as real processes joined by gloo, each loading
its shard from the same oracle checkpoint (index sharing on, contexts several times index_topk)
and running chunked prefill and batched decode through `ModelRunner`, against tp=1 in the
parent. Ranks sample from rank 0's logits, as the scheduler does. The same ranks also run expert
parallelism (ep = 2 at tp = 2; ep = 2 and 4 at tp = 4): each loads only its experts, and greedy
generation (`generate`'s loop) equals transformers' argmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm53.models import ConfigError, GlmConfig, GlmForCausalLM, ModelRunner, PageAllocator, check_tp
from glm53.models.weights import checkpoint_tensors, load_model, load_weights
from glm53.server.offline import greedy_generate
from glm53.support.oracle import BASE, make_checkpoint, quantise_fp8_
from tests.models.tp_harness import (
    DECODE_STEPS, PAGE, PAGES, ReadRecorder, check_reads, greedy, greedy_from_rank0, run_ranks, scenario,
)

SCHEDULE = dict(index_topk_freq=2, index_skip_topk_offset=2)  # F F S F S; layer 0 dense
GEN_STEPS = 12  # greedy generation of the expert-parallel ranks, checked against transformers


def _gen_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 158, (n,), generator=g).tolist() for n in (25, 40)]


def _rank_main(tp, ckpt: str, out: str, eps: tuple[int, ...]) -> None:
    for ep in eps:
        with ReadRecorder() as rec:
            model = load_model(ckpt, dtype=torch.float32, tp=tp, ep=ep, progress=False)
        check_reads(model, rec.reads)  # ep > 1: this rank's experts only (and its width part when ep < tp)
        runner = ModelRunner(model, num_pages=PAGES, page_size=PAGE)
        cfg = runner.cfg
        # The shard still lists full checkpoint shapes (every expert), in the single-rank order.
        with torch.device("meta"):
            whole = GlmForCausalLM(cfg)
        assert list(checkpoint_tensors(runner.model).items()) == list(checkpoint_tensors(whole).items())
        if ep == 1:  # the model checks divisibility before building anything
            odd = GlmConfig.from_dict({**BASE, "num_attention_heads": 3, "num_key_value_heads": 3})
            with pytest.raises(ConfigError, match=f"num_attention_heads: 3 is not divisible by "
                                                  f"tensor_parallel_size={tp.size}"):
                GlmForCausalLM(odd, tp=tp)

        tp.stats.reset()
        res = scenario(runner, greedy_from_rank0(tp))
        stats = dict(vars(tp.stats))
        # Top-k slots gathered from every rank are identical (ties included).
        for t in res["topk"]:
            every = tp.all_gather(t[None], dim=0)
            assert all(torch.equal(every[0], every[r]) for r in range(tp.size))
        gen = greedy_generate(runner, PageAllocator(PAGES), _gen_prompts(), GEN_STEPS, ignore_eos=True) \
            if ep > 1 else None
        torch.save({**res, "stats": stats, "gen": gen}, Path(out) / f"ep{ep}-rank{tp.rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_tp_ranks_match_single_rank(tmp_path, world):
    ckpt = tmp_path / "ckpt"
    oracle = make_checkpoint(ckpt, seed=31, **SCHEDULE)
    single = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False)
    ref = scenario(single, greedy)
    eps = (1, 2) if world == 2 else (1, 2, 4)
    run_ranks(world, _rank_main, str(ckpt), str(tmp_path), eps)
    cfg, forwards = single.cfg, len(ref["tokens"]) - 1 + 4  # decode steps + prefill chunks (56 tokens / 16)
    assert len(ref["tokens"]) - 1 == DECODE_STEPS
    n_tokens = (3 * 8 + 5) + (5 * 8 + 3) + 7 * 8 + 3 * DECODE_STEPS
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)

    for ep in eps:
        ranks = [torch.load(tmp_path / f"ep{ep}-rank{r}.pt") for r in range(world)]
        err = max(float((a - b).abs().max()) for a, b in zip(ranks[0]["logits"], ref["logits"]))
        scale = max(float(b.abs().max()) for b in ref["logits"])
        print(f"tp={world} ep={ep}: max |logit error| vs tp=1 = {err:.3g} (max |logit| {scale:.3g})")
        for a, b in zip(ranks[0]["logits"], ref["logits"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for r in ranks:
            assert r["tokens"] == ref["tokens"]
            # Every rank returns the same full fp32 logits, bit for bit.
            assert all(torch.equal(a, b) for a, b in zip(r["logits"], ranks[0]["logits"]))
            assert len(r["topk"]) == len(ref["topk"]) > 0
            assert all(torch.equal(a, b) for a, b in zip(r["topk"], ref["topk"]))
            assert r["gen"] == ranks[0]["gen"]

            # Collectives per forward: embedding + attention and MLP of each layer all-reduce (with
            # ep > 1 too: the routed and shared outputs share it), lm_head gathers; with ep > 1 two
            # all-to-alls per MoE layer (tokens out to their experts' ranks, results back).
            st = r["stats"]
            assert st["all_reduce_calls"] == forwards * (1 + 2 * cfg.num_hidden_layers)
            assert st["all_reduce_bytes"] == n_tokens * cfg.hidden_size * 4 * (1 + 2 * cfg.num_hidden_layers)
            assert st["all_gather_calls"] == forwards
            assert st["all_gather_bytes"] == n_tokens * cfg.vocab_size // world * 4  # every row gets logits
            assert st["all_to_all_calls"] == (0 if ep == 1 else 2 * moe_layers * forwards)
        # Over the group, each (token, slot) pair goes out to the tp / ep ranks of its expert
        # group and comes back: one row of hidden_size each way.
        rows = n_tokens * moe_layers * cfg.num_experts_per_tok * (world // ep if ep > 1 else 0)
        assert sum(r["stats"]["all_to_all_bytes"] for r in ranks) == 2 * rows * cfg.hidden_size * 4
        if ep > 1:  # greedy generation equals transformers' argmax over the growing sequence
            for p, o in zip(_gen_prompts(), ranks[0]["gen"]):
                with torch.no_grad():
                    logits = oracle(torch.tensor([p + o])).logits[0]
                assert o == logits[len(p) - 1 : len(p) - 1 + GEN_STEPS].argmax(-1).tolist()


def _rank_fp8(tp, ckpt: str) -> None:
    cfg = GlmConfig.from_dir(ckpt)
    full = GlmForCausalLM(cfg)
    load_weights(full, ckpt, progress=False)
    ref = dict(full.named_parameters())
    for ep in (1, 2):
        shard = GlmForCausalLM(cfg, tp=tp, ep=ep)
        with ReadRecorder() as rec:
            load_weights(shard, ckpt, progress=False)
        weights = [r for r in rec.reads if not r[0].endswith("_scale_inv")]
        check_reads(shard, weights)
        # ep = 2: another rank's experts' scales are not read either.
        held = shard.model.layers["1"].mlp.experts.placement.experts
        assert all(int(n.split(".")[5]) in held for n, _, _ in rec.reads if ".mlp.experts." in n)
        for name, p in shard.named_parameters():
            rule, want = p.shard, ref[name]
            if rule.experts is not None:  # routed experts [E, ...]: this rank's range
                want = want[rule.experts.start : rule.experts.stop]
            if not rule.replicated:
                stacked = p.dim() == 3  # the rule indexes one expert's tensor
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

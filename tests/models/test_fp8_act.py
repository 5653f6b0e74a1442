"""The FP8 products' inputs quantized by the kernels that produce them (`kernels/fp8_act`, routed
by `layers.norm_for` and `MLP.forward`), checked through the whole model on a fresh random
block-FP8 checkpoint: with every product forced to take quantized rows, the model must compute
exactly what it computes when each FP8 product quantizes its own input (the emulated w8a8
reference: the same 1×128 groups of the same values). A producer that handed a product the wrong
tensor (the dense input, another norm's output, h before the SwiGLU) or a consumer that read the
rows where it needs the dense input (router, indexer gates) changes the logits."""

from __future__ import annotations

import random

import pytest
import torch

import glm53.models.fused as fused_mod
import glm53.models.layers as layers_mod
import glm53.models.model as model_mod
import glm53.models.moe as moe_mod
from glm53.kernels.fp8_act import two_terms
from glm53.kernels.fp8_gemm import fp8_gemm_reference
from glm53.models import ModelRunner
from glm53.models.weights import load_model
from glm53.support.oracle import FP8_WIDTHS, make_checkpoint, quantise_fp8_
from tests.kernels import fp8_cases
from tests.kernels.fp8_cases import emulate_groups
from tests.models.tp_harness import PAGE, PAGES, greedy, replay_selections, scenario, selections_differ


def _emulated_w8a8(x, w, w_scale, out_dtype=None):
    """An FP8 product that quantizes its own input (per 1×128 group; two terms at decode sizes,
    `two_terms`) and multiplies exactly."""
    x2 = x.reshape(-1, x.shape[-1])
    xq = emulate_groups(x2, two_terms(x2.shape[0])).view(x.shape)
    return fp8_gemm_reference(xq, w, w_scale, out_dtype or x.dtype)


# o_proj's input groups whole within a head: the W_UV product quantizes it (`uv_product_fp8`)
V128 = {**FP8_WIDTHS, "v_head_dim": 128}


def _run(ckpt, monkeypatch, rows: bool) -> tuple[dict, dict]:
    model = load_model(ckpt, dtype=torch.float32, fp8=True, progress=False)
    calls = {"norm": 0, "silu": 0, "uv": 0}
    with monkeypatch.context() as mp:
        mp.setattr(layers_mod, "fp8_gemm", _emulated_w8a8)
        mp.setattr(fused_mod, "fp8_gemm", _emulated_w8a8)
        if rows:  # every FP8 product takes quantized rows (on a GPU: prefill sizes)
            mp.setattr(layers_mod, "takes_fp8_rows", lambda m, n, k, device, fp8: fp8 and m > 0)
            mp.setattr(fused_mod, "takes_fp8_rows", lambda m, n, k, device, fp8: fp8 and m > 0)
            for mod, name, key in ((layers_mod, "rms_norm_fp8", "norm"), (model_mod, "rms_norm_fp8", "norm"),
                                   (layers_mod, "silu_mul_fp8", "silu"), (model_mod, "uv_product_fp8", "uv")):
                inner = getattr(mod, name)

                def spy(*a, _inner=inner, _key=key, **kw):
                    calls[_key] += 1
                    return _inner(*a, **kw)

                mp.setattr(mod, name, spy)
        out = scenario(ModelRunner(model, num_pages=PAGES, page_size=PAGE), greedy)
    return out, calls


@pytest.mark.parametrize("fuse,widths", [(True, FP8_WIDTHS), (False, FP8_WIDTHS), (True, V128)],
                         ids=["fused", "unfused", "fused-v128"])
def test_quantizing_producers_match_products_that_quantize(tmp_path, monkeypatch, fuse, widths):
    seed = random.randrange(2**31)
    print(f"checkpoint seed {seed}")
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=seed, **widths)
    quantise_fp8_(ckpt, block=128)
    if not fuse:
        monkeypatch.setattr(model_mod.Attention, "fuse_projections_", lambda self: 0)
        monkeypatch.setattr(layers_mod.MLP, "fuse_projections_", lambda self: 0)
        monkeypatch.setattr(moe_mod.MoE, "fuse_projections_", lambda self: 0)  # the shared expert's own MLP
    ref, _ = _run(ckpt, monkeypatch, rows=False)
    out, calls = _run(ckpt, monkeypatch, rows=True)
    # every layer's two norms and q_a's norm quantize; every MLP its SwiGLU (the dense one; the
    # shared expert's where it is not held in the routed stacks: unfused)
    assert calls["norm"] > 0 and calls["silu"] > 0, calls
    assert (calls["uv"] > 0) == (widths["v_head_dim"] % 128 == 0), calls
    assert out["tokens"] == ref["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(out["topk"], ref["topk"]))
    for a, b in zip(out["logits"], ref["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the H200 device tool)")
@pytest.mark.parametrize("widths", [FP8_WIDTHS, V128], ids=["v64", "v128"])
def test_gpu_quantizing_producers_match_products_that_quantize(tmp_path, monkeypatch, widths):
    # the same comparison with the Triton kernels in bf16 on the GPU: prefill chunks of 48 rows take
    # the w8a8 product; the producers' output must match the products' own quantization up to the
    # GEMM's and SwiGLU's roundings. Those roundings can flip a near-tied choice of a random model,
    # an expert or a top-k slot, after which a token's hidden state differs by tens of percent (on
    # the H200, 2 random checkpoints in 9 failed a whole-logits bound so): the second run is fed the
    # first's tokens and choices, and its own choices must agree but for such near ties
    seed = random.randrange(2**31)
    print(f"checkpoint seed {seed}")
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=seed, **widths)
    quantise_fp8_(ckpt, block=128)
    outs, recs = [], []
    for rows in (False, True):
        model = load_model(ckpt, dtype=torch.bfloat16, fp8=True, progress=False, device="cuda")
        with monkeypatch.context() as mp, replay_selections(recs[0] if recs else None) as rec:
            if not rows:
                mp.setattr(layers_mod, "takes_fp8_rows", lambda *a: False)
                mp.setattr(fused_mod, "takes_fp8_rows", lambda *a: False)
            pick = greedy if not outs else (lambda rows, _it=iter(outs[0]["tokens"]): next(_it))
            outs.append(scenario(ModelRunner(model, num_pages=PAGES, page_size=PAGE, device="cuda"), pick))
        recs.append(rec)
    ref, out = outs
    differ = selections_differ(recs[0], recs[1])
    a = torch.cat([t.float().flatten() for t in out["logits"]])
    b = torch.cat([t.float().flatten() for t in ref["logits"]])
    rel = ((a - b).norm() / b.norm()).item()
    print(f"logits: relative difference {rel:.2e}, max abs {(a - b).abs().max().item():.3f} of "
          f"{b.abs().max().item():.3f}; rows whose own choice differed: {differ}")
    # a consumer reading the wrong tensor moves most choices, not a few near ties
    assert differ["topk"] < 0.1 and differ["route"] < 0.1, differ
    assert rel < 2e-2, rel


def test_a_replayed_run_takes_the_references_choices(tmp_path):
    # the GPU test's harness (`replay_selections`): a run fed another run's choices takes them (its
    # logits change) and records its own, so `selections_differ` counts where they would part
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=5, **FP8_WIDTHS)

    def runner(noise: float) -> ModelRunner:
        model = load_model(ckpt, dtype=torch.float32, progress=False)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the router and the indexer moved: other experts and other slots
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight") or ".indexer." in name:
                    p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
        return ModelRunner(model, num_pages=PAGES, page_size=PAGE)

    with replay_selections() as ref_rec:
        ref = scenario(runner(0.0), greedy)
    with replay_selections(ref_rec) as rec:
        same = scenario(runner(0.0), lambda rows, _it=iter(ref["tokens"]): next(_it))
    assert selections_differ(ref_rec, rec) == {"topk": 0.0, "route": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(same["logits"], ref["logits"]))

    with replay_selections(ref_rec) as rec:
        fed = scenario(runner(0.5), lambda rows, _it=iter(ref["tokens"]): next(_it))
    with replay_selections():
        free = scenario(runner(0.5), lambda rows, _it=iter(ref["tokens"]): next(_it))
    differ = selections_differ(ref_rec, rec)
    assert 0 < differ["topk"] < 1 and 0 < differ["route"] < 1, differ
    assert len(fed["topk"]) == len(ref_rec["topk"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(fed["topk"], ref_rec["topk"]))
    assert not all(torch.equal(a, b) for a, b in zip(fed["logits"], free["logits"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the H200 device tool)")
def test_gpu_sums_taken_by_the_norms_change_nothing(tmp_path, monkeypatch):
    # o_proj's and the dense MLP's split-K sums and the MoE's slot sums, taken by the norm after
    # them (`row_parts`), against each taken by its own launch: the same logits bit for bit (split-K
    # forced at the tiny widths, where the decode products would not split)
    ckpt = tmp_path / "ckpt"
    fp8_cases.split_fp8_checkpoint(ckpt, monkeypatch, seed=11)
    outs = []
    for lazy in (True, False):
        model = load_model(ckpt, dtype=torch.bfloat16, fp8=True, progress=False, device="cuda")
        with monkeypatch.context() as mp:
            if not lazy:
                fp8_cases.take_sums_eagerly(mp)
            outs.append(scenario(ModelRunner(model, num_pages=PAGES, page_size=PAGE, device="cuda"), greedy))
    assert outs[0]["tokens"] == outs[1]["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["logits"], outs[1]["logits"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the H200 device tool)")
def test_gpu_kernels_launched_early_change_nothing(tmp_path, monkeypatch):
    # Every switch of `launch_early` on (the small kernels, the W_UV product, the MoE down kernel;
    # the decode experts on the w8a8 tile kernels, split-K forced so the sums launch): the same
    # logits bit for bit as with each kernel launched the usual way, eager and in CUDA graphs.
    # A kernel that read its producer's output before waiting would change them.
    import glm53.kernels.fp8_act as fp8_act_mod
    import glm53.kernels.launch_early as launch_early
    import glm53.kernels.moe_fp8_gemv_triton as gemv_mod
    import glm53.kernels.moe_fp8_triton as moe_fp8_mod
    from glm53.models.graph import GraphConfig

    ckpt = tmp_path / "ckpt"
    fp8_cases.split_fp8_checkpoint(ckpt, monkeypatch, seed=12, widths=V128)
    monkeypatch.setattr(gemv_mod, "MOE_GEMV_MAX_TOKENS", 0)
    outs = {}
    for graphs in (False, True):
        for on in (False, True):
            with monkeypatch.context() as mp:
                for mod, name in ((launch_early, "SMALL_KERNELS"), (fp8_act_mod, "UV_PDL"), (moe_fp8_mod, "DOWN_PDL")):
                    mp.setattr(mod, name, on)
                model = load_model(ckpt, dtype=torch.bfloat16, fp8=True, progress=False, device="cuda")
                runner = ModelRunner(model, num_pages=PAGES, page_size=PAGE, device="cuda",
                                     graphs=GraphConfig(max_bs=4, max_context=PAGES * PAGE) if graphs else None)
                outs[graphs, on] = scenario(runner, greedy)
                assert not graphs or runner.graphs.replays
    for graphs in (False, True):
        late, early = outs[graphs, False], outs[graphs, True]
        assert late["tokens"] == early["tokens"]
        assert all(torch.equal(a, b) for a, b in zip(late["logits"], early["logits"], strict=True)), graphs

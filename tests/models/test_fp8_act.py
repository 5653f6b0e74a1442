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
from tests.kernels.fp8_cases import emulate_groups
from tests.models.tp_harness import PAGE, PAGES, greedy, scenario


def _emulated_w8a8(x, w, w_scale, out_dtype=None):
    """An FP8 product that quantizes its own input (per 1×128 group; two terms at decode sizes,
    `two_terms`) and multiplies exactly."""
    x2 = x.reshape(-1, x.shape[-1])
    xq = emulate_groups(x2, two_terms(x2.shape[0])).view(x.shape)
    return fp8_gemm_reference(xq, w, w_scale, out_dtype or x.dtype)


def _run(ckpt, monkeypatch, rows: bool) -> tuple[dict, dict]:
    model = load_model(ckpt, dtype=torch.float32, fp8=True, progress=False)
    calls = {"norm": 0, "silu": 0}
    with monkeypatch.context() as mp:
        mp.setattr(layers_mod, "fp8_gemm", _emulated_w8a8)
        mp.setattr(fused_mod, "fp8_gemm", _emulated_w8a8)
        if rows:  # every FP8 product takes quantized rows (on a GPU: prefill sizes)
            mp.setattr(layers_mod, "takes_fp8_rows", lambda m, n, k, device, fp8: fp8 and m > 0)
            mp.setattr(fused_mod, "takes_fp8_rows", lambda m, n, k, device, fp8: fp8 and m > 0)
            for mod, name, key in ((layers_mod, "rms_norm_fp8", "norm"), (model_mod, "rms_norm_fp8", "norm"),
                                   (layers_mod, "silu_mul_fp8", "silu")):
                inner = getattr(mod, name)

                def spy(*a, _inner=inner, _key=key, **kw):
                    calls[_key] += 1
                    return _inner(*a, **kw)

                mp.setattr(mod, name, spy)
        out = scenario(ModelRunner(model, num_pages=PAGES, page_size=PAGE), greedy)
    return out, calls


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_quantizing_producers_match_products_that_quantize(tmp_path, monkeypatch, fuse):
    seed = random.randrange(2**31)
    print(f"checkpoint seed {seed}")
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=seed, **FP8_WIDTHS)
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
    assert out["tokens"] == ref["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(out["topk"], ref["topk"]))
    for a, b in zip(out["logits"], ref["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the H200 device tool)")
def test_gpu_quantizing_producers_match_products_that_quantize(tmp_path, monkeypatch):
    # the same comparison with the Triton kernels in bf16 on the GPU: prefill chunks of 48 rows take
    # the w8a8 product; the producers' output must match the products' own quantization up to the
    # GEMM's and SwiGLU's roundings
    seed = random.randrange(2**31)
    print(f"checkpoint seed {seed}")
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=seed, **FP8_WIDTHS)
    quantise_fp8_(ckpt, block=128)
    outs = []
    for rows in (False, True):
        model = load_model(ckpt, dtype=torch.bfloat16, fp8=True, progress=False, device="cuda")
        with monkeypatch.context() as mp:
            if not rows:
                mp.setattr(layers_mod, "takes_fp8_rows", lambda *a: False)
                mp.setattr(fused_mod, "takes_fp8_rows", lambda *a: False)
            outs.append(scenario(ModelRunner(model, num_pages=PAGES, page_size=PAGE, device="cuda"), greedy))
    ref, out = outs
    a = torch.cat([t.float().flatten() for t in out["logits"]])
    b = torch.cat([t.float().flatten() for t in ref["logits"]])
    rel = ((a - b).norm() / b.norm()).item()
    print(f"logits: relative difference {rel:.2e}, max abs {(a - b).abs().max().item():.3f} of {b.abs().max().item():.3f}")
    assert rel < 2e-2, rel

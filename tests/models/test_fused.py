"""Fused projections (`models/fused`): the linears that share an input computed as one product,
checked against the same model unfused on fresh random checkpoints, fp32 and block-FP8
(ragged widths: kv_a's rows are not whole 128-blocks, so the fused weight carries padding rows),
with the members' parameters left as views of the fused weight under their checkpoint names."""

from __future__ import annotations

import random

import pytest
import torch

from glm53.kernels.fp8_quant import dequantize_fp8_blocks, quantize_fp8_blocks
from glm53.models import ModelRunner
from glm53.models.fused import FusedLinear, fuse_projections_
from glm53.models.layers import Linear, param
from glm53.models.weights import load_model
from glm53.support.oracle import FP8_WIDTHS, make_checkpoint, quantise_fp8_
from tests.models.tp_harness import PAGE, PAGES, greedy, scenario


def _seed() -> int:
    seed = random.randrange(2**31)
    print(f"checkpoint seed {seed}")
    return seed


def _inside(view: torch.Tensor, whole: torch.Tensor) -> bool:
    start = whole.data_ptr()
    end = start + whole.numel() * whole.element_size()
    return start <= view.data_ptr() < end


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "block-fp8"])
def test_fused_model_matches_unfused(tmp_path, fp8):
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=_seed(), **FP8_WIDTHS)
    if fp8:
        quantise_fp8_(ckpt, block=128)
    plain = load_model(ckpt, dtype=torch.float32, fp8=fp8, progress=False)
    fused = load_model(ckpt, dtype=torch.float32, fp8=fp8, progress=False)
    names_before = {n: tuple(p.shape) for n, p in fused.named_parameters()}
    made = fuse_projections_(fused)
    layers = list(fused.model.layers.values())
    full = sum(layer.self_attn.indexer is not None for layer in layers)
    mlps = sum(1 for m in fused.modules() if hasattr(m, "gate_up"))
    # proj_x each layer, proj_q with an indexer, gate_up per MLP (a MoE's shared expert: held in
    # the routed experts' stacks instead)
    assert made == len(layers) + full + mlps
    assert fuse_projections_(fused) == made  # idempotent: the same fused products, none new
    # checkpoint names and shapes unchanged, members are views of their fused weight
    assert {n: tuple(p.shape) for n, p in fused.named_parameters()} == names_before
    for layer in layers:
        a = layer.self_attn
        assert _inside(a.kv_a_proj_with_mqa.weight, a.proj_x.weight)
        if fp8:
            assert a.proj_x.scale is not None and _inside(a.kv_a_proj_with_mqa.weight_scale_inv, a.proj_x.scale)
            assert a.proj_x.weight.shape[0] % 128 == 0
        if a.indexer is not None:
            assert _inside(a.indexer.wk.weight, a.proj_x.weight) and _inside(a.indexer.wq_b.weight, a.proj_q.weight)
        if hasattr(layer.mlp, "experts"):  # the shared expert is the stacks' last expert
            e, sh = layer.mlp.experts, layer.mlp.shared_experts
            assert e.shared_id == e.gate_proj.shape[0] and sh.gate_up is None
            for proj, lin in zip(e.PROJS, (sh.gate_proj, sh.up_proj, sh.down_proj)):
                assert e.stacks[proj].shape[0] == e.shared_id + 1 and _inside(lin.weight, e.stacks[proj])
                assert _inside(getattr(e, proj), e.stacks[proj])
                if fp8:
                    assert _inside(lin.weight_scale_inv, e.stacks[proj + "_scale_inv"])

    # The runner fuses on construction: the reference drops its fused products again afterwards.
    ref_runner = ModelRunner(plain, num_pages=PAGES, page_size=PAGE)
    for m in plain.modules():  # undo: the reference computes each member alone
        for attr in ("proj_x", "proj_q", "gate_up"):
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)
        if getattr(m, "shared_id", None) is not None:  # the shared expert computed by its own MLP
            m.shared_id, m.stacks = None, {}
    ref = scenario(ref_runner, greedy)
    out = scenario(ModelRunner(fused, num_pages=PAGES, page_size=PAGE), greedy)
    assert out["tokens"] == ref["tokens"]
    assert len(out["topk"]) == len(ref["topk"]) and all(torch.equal(a, b) for a, b in zip(out["topk"], ref["topk"]))
    for a, b in zip(out["logits"], ref["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_linear_fp8_padding_and_refusals():
    torch.manual_seed(random.randrange(2**31))
    k = 320  # a partial last K block
    members = []
    for n in (200, 64, 128):  # 200 and 64: partial row blocks, padded in the fused weight
        lin = Linear(k, n, torch.float32)
        q, s = quantize_fp8_blocks(torch.randn(n, k) * k**-0.5)
        lin.weight = param(n, k, dtype=torch.float8_e4m3fn)
        lin.weight.data.copy_(q)
        lin.weight_scale_inv = param(*s.shape, dtype=torch.float32)
        lin.weight_scale_inv.data.copy_(s)
        members.append(lin)
    x = torch.randn(7, k)
    want = [x @ dequantize_fp8_blocks(m.weight, m.weight_scale_inv).t() for m in members]
    fused = FusedLinear.of(members)
    assert fused is not None and fused.weight.shape == (256 + 128 + 128, k) and fused.scale.shape == (4, 3)
    assert fused.starts == (0, 256, 384) and fused.widths == (200, 64, 128)
    # fp32 products of 320 terms of ~1: the stacked product's BLAS blocking sums them in another
    # order (a seed gave 1.3e-6 at one element of 1,400), so 1e-5
    for got, ref, m in zip(fused(x), want, members):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)  # each member alone still works
    # padding rows are zero (a product there is dropped, but must stay finite)
    assert not fused.weight[200:256].float().any()

    # forms that cannot share one product are left alone
    a, b = Linear(k, 8, torch.float32), Linear(k, 8, torch.float32)
    a.weight.data.normal_()
    b.weight.data.normal_()
    assert FusedLinear.of([a, members[0]]) is None  # fp32 with block-FP8
    assert FusedLinear.of([a, Linear(k + 1, 8, torch.float32)]) is None  # another input width
    assert FusedLinear.of([a]) is None
    b.weight.requires_grad_(True)
    assert FusedLinear.of([a, b]) is None  # trainable: the stacked copy would cut its gradient
    b.weight.requires_grad_(False)
    before = a.weight
    f = FusedLinear.of([a, b])
    assert f is not None and a.weight is not before and torch.equal(a.weight, before)
    # (unit-normal weights: sums of ~18, summed in another order by the stacked product's BLAS)
    torch.testing.assert_close(torch.cat(f(x), -1), torch.cat([x @ before.t(), x @ b.weight.t()], -1),
                               rtol=1e-5, atol=1e-4)


def test_index_first_rule(tmp_path, monkeypatch):
    # `Attention._index_first`: q_b and wq_b as two products (wq_b first) only with a side
    # stream, at up to overlap.INDEX_FIRST_MAX_ROWS rows, on layers whose two were fused
    from glm53.models import overlap

    make_checkpoint(tmp_path, seed=_seed(), index_topk_freq=2, index_skip_topk_offset=2)
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    layers = [layer.self_attn for layer in model.model.layers.values()]
    full = [a for a in layers if a.indexer is not None]
    shared = [a for a in layers if a.indexer is None]
    assert full and shared
    side, x = object(), torch.randn(4, full[0].q_b_proj.weight.shape[1])  # any stream stands in
    assert not any(a._index_first(side, x, 1) for a in layers)  # nothing fused yet
    fuse_projections_(model)
    monkeypatch.setattr(overlap, "INDEX_FIRST_MAX_ROWS", 4)
    for a in full:
        assert a._index_first(side, x, 1) and a._index_first(side, x, 4)
        assert not a._index_first(side, x, 5) and not a._index_first(None, x, 1)
    assert not any(a._index_first(side, x, 1) for a in shared)
    monkeypatch.setattr(overlap, "INDEX_FIRST_MAX_ROWS", 0)
    assert not any(a._index_first(side, x, 1) for a in full)


def test_index_first_matches_the_fused_query_product(tmp_path, monkeypatch):
    # The index-first attention (`Attention._index_first`: the indexer's own query product first,
    # then q_b and the absorbed query; on a GPU beside it on the side stream) forced on at every
    # size on the CPU, where its branch runs in line: the same tokens, top-k and logits as the
    # fused q_b | wq_b product. It is otherwise GPU-only (it needs the side stream): a fault in it
    # once failed there alone.
    from glm53.models.model import Attention

    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, seed=_seed(), **FP8_WIDTHS)
    ref = scenario(ModelRunner(load_model(ckpt, dtype=torch.float32, progress=False), num_pages=PAGES,
                               page_size=PAGE), greedy)
    taken = []

    def index_first(self, side, q_in, n):
        taken.append(self.proj_q is not None)
        return self.proj_q is not None

    monkeypatch.setattr(Attention, "_index_first", index_first)
    out = scenario(ModelRunner(load_model(ckpt, dtype=torch.float32, progress=False), num_pages=PAGES,
                               page_size=PAGE), greedy)
    assert any(taken)
    assert out["tokens"] == ref["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(out["topk"], ref["topk"]))
    for a, b in zip(out["logits"], ref["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

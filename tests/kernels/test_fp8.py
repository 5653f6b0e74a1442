"""Block-FP8 on CPU (no Triton kernel runs here): the weight format's round trip, the activation
quantizer's rule, the CPU dispatch to the torch references, and the dispatchers' one rule.
The Triton kernels are checked in test_interp_cases.py (interpreter) and test_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from glm53.kernels import fp8_gemm, fp8_quant, moe_fp8

from . import fp8_cases

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(29)


def test_block_weight_format_roundtrip():
    # kv_a's 576 rows (a partial row block) and a partial K block; every block at its own scale
    w = torch.randn(576, 300) * torch.logspace(-6, 3, 576)[:, None]
    q, s = fp8_quant.quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (576, 300) and s.shape == (5, 3)
    deq = fp8_quant.dequantize_fp8_blocks(q, s)
    s_el = s.repeat_interleave(128, 0)[:576].repeat_interleave(128, 1)[:, :300]
    assert torch.all((deq - w).abs() <= w.abs() * 2.0**-4 + s_el * 2.0**-10 + w.abs() * 1e-6)
    # each block's largest element lands on ±448; experts are batch dims
    blocks = torch.nn.functional.pad(q.float().abs(), (0, 84, 0, 64)).view(5, 128, 3, 128).amax(dim=(1, 3))
    assert torch.all(blocks == 448)
    qe, se = fp8_quant.quantize_fp8_blocks(torch.stack([w[:256], 2 * w[:256]]))
    assert se.shape == (2, 2, 3) and torch.equal(se[0], s[:2]) and torch.equal(se[1], 2 * s[:2])
    assert torch.equal(fp8_quant.dequantize_fp8_blocks(qe, se)[0], fp8_quant.dequantize_fp8_blocks(q[:256], s[:2]))


def test_activation_quantizer_rule_and_zero_groups():
    x = fp8_cases.activations(9, 300, torch.float32, "ranges")
    q, s = fp8_quant.quantize_fp8_groups_reference(x)
    g = torch.nn.functional.pad(x.abs(), (0, 84)).view(9, 3, 128).amax(-1)
    assert torch.equal(s, g.clamp_min(fp8_quant.AMAX_EPS) / 448)
    zero = g == 0
    assert zero.any() and torch.all(s[zero] > 0)
    deq = fp8_quant.dequantize_fp8_groups(q, s)
    assert torch.isfinite(deq).all() and torch.all(deq.view(-1)[x.view(-1) == 0] == 0)
    err = (deq - x).abs()
    assert torch.all(err <= x.abs() * 2.0**-4 + s.repeat_interleave(128, 1)[:, :300] * 2.0**-10 + 1e-30)
    # the bound is tight enough to fail: a one-step mis-rounding breaks it somewhere
    assert (err / x.abs().clamp_min(1e-30))[x.abs() * 2**6 > s.repeat_interleave(128, 1)[:, :300]].max() > 2.0**-6


@pytest.mark.skipif(IN_INTERPRETER, reason="interpreter process")
def test_cpu_tensors_take_the_references():
    q, s = fp8_cases.block_weight(200, 300, "mixed")
    x = torch.randn(3, 5, 300, dtype=torch.bfloat16)
    y = fp8_gemm.fp8_gemm(x, q, s)
    assert y.shape == (3, 5, 200) and y.dtype == torch.bfloat16
    assert torch.equal(y, fp8_gemm.fp8_gemm_reference(x, q, s))
    assert torch.equal(y, (x.float() @ fp8_quant.dequantize_fp8_blocks(q, s).t()).to(torch.bfloat16))
    xq = fp8_quant.quantize_fp8_groups(x[0])
    xr = fp8_quant.quantize_fp8_groups_reference(x[0])
    assert torch.equal(xq[0].view(torch.uint8), xr[0].view(torch.uint8)) and torch.equal(xq[1], xr[1])
    for fused in (False, True):
        inputs = fp8_cases.moe_fp8_inputs(9, 136, 160, 6, 3, torch.bfloat16, n_empty=1, fused=fused)
        out = moe_fp8.moe_experts_fp8(*inputs)
        assert out.dtype == torch.bfloat16 and torch.equal(out, moe_fp8.moe_experts_fp8_reference(*inputs))
        exact = fp8_cases._moe_emulated(inputs, False, torch.float64)
        assert max(fp8_cases.block_rel_errs(out, exact)) < 8e-3


def test_dispatch_rules_are_one_threshold(monkeypatch):
    # measured: w8a8 at every size, for the linears and the experts alike
    assert fp8_gemm.W8A16_MAX_M == moe_fp8.MOE_W8A16_MAX_TOKENS == 0
    assert fp8_gemm.fp8_variant(1) == moe_fp8.moe_fp8_variant(1) == "w8a8"
    monkeypatch.setattr(fp8_gemm, "W8A16_MAX_M", 32)
    monkeypatch.setattr(moe_fp8, "MOE_W8A16_MAX_TOKENS", 32)
    assert fp8_gemm.fp8_variant(1) == fp8_gemm.fp8_variant(32) == "w8a16" and fp8_gemm.fp8_variant(33) == "w8a8"
    assert moe_fp8.moe_fp8_variant(32) == "w8a16" and moe_fp8.moe_fp8_variant(33) == "w8a8"


def test_moe_gemv_rule_takes_narrow_experts_at_a_few_tokens():
    # the per-pair GEMVs (w8a16) where measured faster: up to MOE_GEMV_MAX_TOKENS tokens on experts
    # at most MOE_GEMV_MAX_INTER wide (GLM-5 at tp = 8: 256), not on the slice's 2048
    from glm53.kernels.moe_fp8_gemv_triton import MOE_GEMV_MAX_INTER, MOE_GEMV_MAX_TOKENS

    top, wide = MOE_GEMV_MAX_TOKENS, MOE_GEMV_MAX_INTER
    assert (top, wide) == (2, 256)
    assert [moe_fp8.moe_fp8_variant(n, 256) for n in (1, top, top + 1)] == ["w8a16", "w8a16", "w8a8"]
    assert moe_fp8.moe_fp8_variant(1, 2048) == moe_fp8.moe_fp8_variant(1, 0) == "w8a8"


def test_cublas_route_needs_rows_a_gpu_and_a_shape_it_takes(monkeypatch):
    from glm53.kernels import fp8_gemm_cublas

    monkeypatch.setattr(fp8_gemm, "W8A16_MAX_M", 32)
    m = fp8_gemm.CUBLAS_MIN_M
    # the measured rule (fp8_gemm_cublas docstring): N % 16, ceil(K/128) % 4
    assert fp8_gemm_cublas.supports(576, 6144) and fp8_gemm_cublas.supports(3584, 512)
    assert not fp8_gemm_cublas.supports(6144, 256) and not fp8_gemm_cublas.supports(200, 512)
    assert not fp8_gemm_cublas.supports(512, 640) and not fp8_gemm_cublas.supports(512, 1000)
    # never on CPU; with a GPU that has it, from CUBLAS_MIN_M rows on shapes it takes
    assert fp8_gemm.fp8_variant(4096, 576, 6144, torch.device("cpu")) == "w8a8"
    monkeypatch.setattr(fp8_gemm_cublas, "available", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert fp8_gemm.fp8_variant(m, 576, 6144, cuda) == "cublas"
    assert fp8_gemm.fp8_variant(m - 1, 576, 6144, cuda) == "w8a8"
    assert fp8_gemm.fp8_variant(m, 6144, 256, cuda) == "w8a8"
    assert fp8_gemm.fp8_variant(32, 576, 6144, cuda) == "w8a16"


def test_glm5_tp8_shapes():
    # the per-rank widths the GPU tests and the benchmark use (GLM-5 at tp = 8)
    sh = fp8_cases.GLM5_TP8_LINEARS
    assert sh["kv_a_proj_with_mqa"] == (576, 6144) and sh["q_b_proj"] == (2048, 2048)
    assert sh["kv_b_proj"] == (3584, 512) and sh["o_proj"] == (6144, 2048)
    assert fp8_cases.GLM5_TP8_EXPERTS == dict(E=256, H=6144, I=256, k=8)


@pytest.mark.skipif(IN_INTERPRETER, reason="the interpreter has its own tiles")
def test_decode_split_rule(monkeypatch):
    # decode tiles on a 132-SM GPU (no GPU needed: the rule reads the SM count only): K split to
    # fill the SMs, except a two-block K (never) and, past one row tile, a w8a8 product under 32
    # blocks (never); one row tile splits evenly from 16 blocks on
    from glm53.kernels import dispatch, fp8_gemm_triton as t

    monkeypatch.setattr(dispatch, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    split = lambda m, n, k, a8: t.default_config(m, n, k, a8, cuda).SPLIT_K  # noqa: E731
    assert split(1, 6144, 2048, False) == 4 and split(32, 3072, 6144, False) == 6
    lo1 = lambda n, k: t.default_config(1, n, k, True, cuda, lo=True)  # noqa: E731
    # the slice's shapes at one row: the fewest even splits giving ~2 programs an SM, 4+ blocks each
    assert [lo1(n, k).SPLIT_K for n, k in ((6144, 16384), (6144, 12288), (2816, 6144), (2688, 6144),
                                          (4096, 2048), (16384, 2048))] == [4, 3, 6, 6, 4, 1]
    assert lo1(2048, 2048).SPLIT_K == 4  # no even split fills the SMs: the most
    assert lo1(6144, 1024).SPLIT_K == 1 and lo1(6144, 1024).num_stages == 4  # under 16 blocks: as before
    monkeypatch.setattr(t, "DEEP_ONE_ROW", False)  # the rule before (benchmarks/decode_tiles.py's A/B)
    assert (lo1(4096, 2048).SPLIT_K, lo1(4096, 2048).num_stages, lo1(6144, 16384).SPLIT_K) == (1, 4, 3)
    assert lo1(24576, 6144).num_warps == 4
    monkeypatch.setattr(t, "DEEP_ONE_ROW", True)
    # 8 warps where the tiles alone give two programs an SM
    assert lo1(24576, 6144).num_warps == 8 and lo1(16384, 2048).num_warps == lo1(6144, 16384).num_warps == 4
    assert split(1, 6144, 256, False) == split(64, 6144, 256, True) == 1
    assert split(64, 6144, 2048, True) == split(64, 6144, 1536, True) == 1
    assert split(64, 2816, 6144, True) == 6 and split(64, 512, 6144, True) == 16
    assert split(1, 24576, 6144, False) == 1  # enough tiles already
    # two activation terms: 2M virtual rows a tile, 64-row tiles of 128 columns past 32 rows
    tile = lambda m: (lambda c: (c.BM, c.BN))(t.default_config(m, 6144, 16384, True, cuda, lo=True))  # noqa: E731
    assert tile(1) == tile(8) == (16, 64) and tile(16) == (32, 64) and tile(64) == (64, 128)
    # up to 32 virtual rows (one row tile) the weight tile is the left operand; past it, not
    swap = lambda m, lo: t.default_config(m, 6144, 16384, True, cuda, lo=lo).SWAP  # noqa: E731
    assert swap(1, True) and swap(16, True) and swap(32, False) and not swap(17, True) and not swap(64, False)
    assert t.default_config(64, 6144, 16384, True, cuda, lo=True).SPLIT_K == 3  # 2 x 48 tiles: ~2 programs an SM


def test_norm_warps_follow_the_values_loaded():
    # one warp per 512 loaded values, a power of two in [1, 16]: a split product's parts summed
    # into a narrow row raise it (the q_a norm, 2,048 wide over 7 fp32 parts: 16 where its width
    # alone gives 4); a plain row keeps what its tile gave before (8,192 -> 16, 2,048 -> 4)
    from glm53.kernels.fp8_act import norm_warps

    assert norm_warps(8192, 1) == norm_warps(8192, 9) == 16
    assert norm_warps(2048, 1) == 4 and norm_warps(2048, 3) == 8 and norm_warps(2048, 7) == 16
    assert norm_warps(512, 1) == norm_warps(256, 2) == 1 and norm_warps(512, 7) == 4
    warps = [norm_warps(t, r) for t in (128, 512, 2048, 8192) for r in range(1, 12)]
    assert all(w & (w - 1) == 0 for w in warps)

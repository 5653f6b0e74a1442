"""tools/triton_build.py: the launchers' own launches at GLM-5 shapes, compiled for sm_90 here
(no GPU): every variant builds, fits an SM (registers x threads, shared memory), the rules pick
the tiles the H200 runs (top-k's finish split, swapped decode FP8 tiles, splits at decode
sizes), and the cases together launch every Triton kernel of glm53.kernels (the Gluon ones:
tools/gluon_build.py)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SM_REGISTERS = 65536  # a Hopper SM's register file (32-bit registers)
SM_SHARED = 232448  # the most shared memory one block may take on sm_90 (227 KB)
CASES = ["topk", "fp8_gemm", "moe_fp8", "attention", "norms", "moe", "draft"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("triton_build", ROOT / "tools" / "triton_build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["triton_build"] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def launches(tool):
    return functools.cache(tool.launches)  # each case's launchers run once for both tests


def values(built: list, kernel: str, key: str) -> set:
    """The values constexpr `key` takes over the built variants of `kernel`."""
    return {b.constexprs[key] for b in built if b.name == kernel}


def check_topk(built: list, names: set) -> None:
    assert {"_bracket_kernel", "_scan_kernel", "_finish_kernel"} <= names
    assert values(built, "_finish_kernel", "NR") == {1, 2}, "two finish programs a row while 2B <= SMs, then one"


def check_fp8_gemm(built: list, names: set) -> None:
    swapped = {b.constexprs["BM"] for b in built if b.name == "_block_fp8_gemm_kernel" and b.constexprs["SWAP"]}
    assert swapped == {16, 32}, "decode products of up to 32 virtual rows take the swapped tile"
    early = {b.constexprs["PREFETCH"] for b in built if b.name == "_block_fp8_gemm_kernel" and b.constexprs["PDL"]}
    assert early == {256}, "the swapped tiles launch early and prefetch (the L2 prefetch's inline PTX builds)"
    assert "_sum_parts_kernel" in names
    deep = [b for b in built if b.name == "_block_fp8_gemm_kernel" and b.options.get("num_stages") == 6]
    assert {(b.constexprs["BM"], b.options["num_warps"]) for b in deep} == {(16, 4), (32, 4), (16, 8), (32, 8)}
    assert all(b.shared <= 227 * 1024 and b.local_bytes == 0 for b in deep), [(b.shared, b.local_bytes) for b in deep]


def check_moe_fp8(built: list, names: set) -> None:
    assert any(b.constexprs.get("SWAP") for b in built if b.name == "_gate_up_fp8_kernel")
    assert values(built, "_route_plan_kernel", "E") == {17, 257}, "routed and planned in the experts' launch"
    assert {"_gate_up_gemv_kernel", "_down_gemv_kernel", "_down_fp8_kernel"} <= names


def check_attention(built: list, names: set) -> None:
    assert {"_absorbed_query_kernel", "_store_rows_kernel", "_linear_f32_kernel"} <= names
    assert values(built, "_store_rows_kernel", "XPARTS") == {1, 3}, "a split-K sum taken by the cache-row stores"
    assert values(built, "_store_rows_kernel", "TWO") == {False, True}, "a layer's two cache rows in one launch"
    assert values(built, "_indexer_logits_kernel", "FP8") == {False, True}, "bf16 and FP8 index keys"
    assert values(built, "_indexer_logits_kernel", "HALF") == {0, 32}, "q rotated as the bf16 keys' logits load it"
    for kernel in ("_sparse_mla_kernel", "_sparse_mla_fp8_kernel"):
        assert values(built, kernel, "SPLIT") == {True, False}, f"{kernel}: decode splits its slots, prefill not"
    # 1 token: 32 splits (FP8: 64, of 32-slot blocks), 64 tokens: 2
    assert values(built, "_combine_kernel", "BLOCK_SP") == {2, 32, 64}


def check_norms(built: list, names: set) -> None:
    assert {"_rms_norm_kernel", "_rope_kernel", "_step_inputs_kernel"} <= names
    for kernel in ("_rms_norm_fp8_kernel", "_silu_mul_fp8_kernel"):
        assert values(built, kernel, "LO") == {True, False}, f"{kernel}: the second term at decode sizes only"
        assert values(built, kernel, "TRIGGER") == {True}, f"{kernel}: lets the product after it launch early"
    assert values(built, "_rms_norm_kernel", "ADD") == {True, False}
    for kernel in ("_rms_norm_kernel", "_rms_norm_fp8_kernel"):
        assert values(built, kernel, "XPARTS") == {1, 3}, f"{kernel}: a split-K sum taken as its input rows"
    assert values(built, "_sum_parts_kernel", "ADD") == {True}, "a stage's last residual add takes its sum"


def check_moe(built: list, names: set) -> None:
    assert {"_linear_f32_kernel", "_route_kernel", "_plan_kernel", "_down_kernel", "_sum_parts_kernel"} <= names
    assert values(built, "_gate_up_kernel", "BM") == {16, 64, 128}, "decode, mid and prefill tiles"
    assert values(built, "_gate_up_kernel", "E") == {257}, "the shared expert in the routed stack"


def check_draft(built: list, names: set) -> None:
    assert values(built, "_draft_attn_kernel", "SPLIT") == {True, False}
    assert values(built, "_combine_kernel", "BLOCK_M") == {32, 128}, "the splits merged at both block sizes"
    assert all(b.local_bytes == 0 for b in built if b.name == "_combine_kernel"), "the combine spills"
    assert "_markov_step_kernel" in names


RULES = {"topk": check_topk, "fp8_gemm": check_fp8_gemm, "moe_fp8": check_moe_fp8, "attention": check_attention,
         "norms": check_norms, "moe": check_moe, "draft": check_draft}


@pytest.mark.parametrize("case", CASES)
def test_launches_build_for_sm90(tool, launches, case):
    built = [tool.build(la) for la in launches(case)]
    for b in built:
        threads = 32 * b.options.get("num_warps", 4)
        assert b.registers * threads <= SM_REGISTERS, (b.name, b.constexprs, b.registers, threads)
        assert b.shared <= SM_SHARED, (b.name, b.constexprs, b.shared)
    RULES[case](built, {b.name for b in built})


def test_cases_launch_every_triton_kernel(tool, launches):
    from triton.experimental.gluon._runtime import GluonJITFunction

    assert sorted(tool.CASES) == sorted(CASES) == sorted(RULES)
    launched = {la.kernel for case in CASES for la in launches(case)}
    assert not any(isinstance(k, GluonJITFunction) for k in launched), "a case routed to a Gluon kernel"
    missed = [f"{k.__module__}.{k.fn.__name__}" for k in tool.glm53_kernels()
              if not isinstance(k, GluonJITFunction) and k not in launched]
    assert not missed, f"no case launches {missed}"


def test_kernels_launched_early_build_for_sm90(tool, monkeypatch):
    # the switches that launch kernels early (off until timed on a GPU), on: every small kernel of
    # the cases launches early, the W_UV product and the decode MoE down kernel prefetch, and each
    # builds (griddepcontrol and the bulk prefetch are inline PTX)
    import glm53.kernels.fp8_act as fp8_act
    import glm53.kernels.launch_early as launch_early
    import glm53.kernels.moe_fp8_triton as moe_fp8

    monkeypatch.setattr(launch_early, "SMALL_KERNELS", True)
    monkeypatch.setattr(fp8_act, "UV_PDL", True)
    monkeypatch.setattr(moe_fp8, "DOWN_PDL", True)
    monkeypatch.setattr(moe_fp8, "DOWN_PREFETCH", 256)  # off as shipped (timed), kept buildable as a knob
    built = [tool.build(la) for case in ("norms", "attention", "moe", "moe_fp8") for la in tool.launches(case)]
    small = {b.name for b in built if "PDL" in b.constexprs and "PREFETCH" not in b.constexprs}
    assert {"_rms_norm_kernel", "_rms_norm_fp8_kernel", "_silu_mul_fp8_kernel", "_store_rows_kernel",
            "_linear_f32_kernel", "_route_kernel", "_plan_kernel", "_absorbed_query_kernel", "_indexer_logits_kernel",
            "_rope_kernel", "_sparse_mla_kernel", "_sparse_mla_fp8_kernel", "_sum_parts_kernel",
            "_quant_groups_kernel"} <= small
    late = {b.name for b in built if b.name in small and not b.constexprs["PDL"]}
    assert not late, f"launched the usual way with the switch on: {late}"
    uv = {(b.constexprs["PDL"], b.constexprs["PREFETCH"]) for b in built if b.name == "_uv_fp8_kernel"}
    assert uv == {(True, 1024)}, "the W_UV product launches early and prefetches its rows"
    down = {(b.constexprs["PDL"], b.constexprs["PREFETCH"]) for b in built if b.name == "_down_fp8_kernel"}
    assert (True, 256) in down, "the decode down kernel launches early and prefetches"
    assert True in values(built, "_gate_up_fp8_kernel", "TRIGGER"), "gate+up lets the down kernel launch early"

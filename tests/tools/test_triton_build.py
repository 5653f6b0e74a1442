"""tools/triton_build.py: the launchers' own launches at GLM-5 shapes, compiled for sm_90 here
(no GPU): every variant builds, fits an SM (registers x threads, shared memory), and the rules pick
the tiles the H200 runs (one-program top-k rows, swapped decode FP8 tiles)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SM_REGISTERS = 65536  # a Hopper SM's register file (32-bit registers)
SM_SHARED = 232448  # the most shared memory one block may take on sm_90 (227 KB)


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("triton_build", ROOT / "tools" / "triton_build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["triton_build"] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("case", ["topk", "fp8_gemm", "moe_fp8"])
def test_launches_build_for_sm90(tool, case):
    launches = tool.launches(case)
    built = [tool.build(la) for la in launches]
    names = {b.name for b in built}
    for b in built:
        threads = 32 * b.options.get("num_warps", 4)
        assert b.registers * threads <= SM_REGISTERS, (b.name, b.constexprs, b.registers, threads)
        assert b.shared <= SM_SHARED, (b.name, b.constexprs, b.shared)
    if case == "topk":
        one = [b for b in built if b.name == "_one_pass_kernel"]
        assert {b.constexprs["W"] for b in one} == {2048, 4096, 8192}, "rows up to 8K take one program"
        assert all(b.local_bytes == 0 for b in one), "the one-program row spills"
        assert {"_bracket_kernel", "_scan_kernel", "_finish_kernel"} <= names, "wider rows take three kernels"
    elif case == "fp8_gemm":
        swapped = {b.constexprs["BM"] for b in built if b.name == "_block_fp8_gemm_kernel" and b.constexprs["SWAP"]}
        assert swapped == {16, 32}, "decode products of up to 32 virtual rows take the swapped tile"
        assert "_sum_splits_kernel" in names
    else:
        assert any(b.constexprs.get("SWAP") for b in built if b.name == "_gate_up_fp8_kernel")
        assert {"_gate_up_gemv_kernel", "_down_gemv_kernel", "_down_fp8_kernel"} <= names

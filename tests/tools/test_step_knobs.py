"""benchmarks/step_knobs.py: the settings it parses and the constants it sets and restores (its GPU
timing runs through the device tool, not here)."""

import importlib

import pytest

from benchmarks.step_knobs import Knob, apply, parse_setting
from glm53.kernels import fp8_gemm_triton, moe_fp8_triton


def test_settings_parse_into_constants_that_exist():
    name, knobs = parse_setting("both: glm53.kernels.moe_fp8_triton.DOWN_PREFETCH=256;"
                                "glm53.kernels.moe_fp8_triton.SPLIT_WAVES=2.0;")
    assert name == "both"
    assert knobs == [Knob("glm53.kernels.moe_fp8_triton", "DOWN_PREFETCH", 256),
                     Knob("glm53.kernels.moe_fp8_triton", "SPLIT_WAVES", 2.0)]
    for bad in ("nocolon", "shipped:glm53.kernels.moe_fp8_triton.DOWN_PREFETCH=1", "x:",
                "x:glm53.kernels.moe_fp8_triton.DOWN_PREFECTH=1", "x:DOWN_PREFETCH=1",
                "x:glm53.kernels.moe_fp8_triton.DOWN_PREFETCH"):
        with pytest.raises(ValueError):
            parse_setting(bad)


def test_each_setting_starts_from_the_shipped_constants():
    deep_key = ("glm53.kernels.fp8_gemm_triton", "DEEP_ONE_ROW")
    waves_key = ("glm53.kernels.moe_fp8_triton", "SPLIT_WAVES")
    shipped = {deep_key: fp8_gemm_triton.DEEP_ONE_ROW, waves_key: moe_fp8_triton.SPLIT_WAVES}
    _, deep = parse_setting("deep:glm53.kernels.fp8_gemm_triton.DEEP_ONE_ROW=False")
    _, waves = parse_setting("waves:glm53.kernels.moe_fp8_triton.SPLIT_WAVES=2.0")
    try:
        apply(deep, shipped)
        assert (fp8_gemm_triton.DEEP_ONE_ROW, moe_fp8_triton.SPLIT_WAVES) == (False, shipped[waves_key])
        apply(waves, shipped)  # the deep setting undone
        assert (fp8_gemm_triton.DEEP_ONE_ROW, moe_fp8_triton.SPLIT_WAVES) == (shipped[deep_key], 2.0)
    finally:
        apply([], shipped)
    assert (fp8_gemm_triton.DEEP_ONE_ROW, moe_fp8_triton.SPLIT_WAVES) == (shipped[deep_key], shipped[waves_key])


def test_switching_back_to_shipped_restores_every_switch():
    # step_knobs and decode_tiles time their baselines under early_launch.switch("shipped"), after
    # other variants have set the same constants otherwise
    import glm53.kernels.fp8_act as fp8_act
    import glm53.kernels.launch_early as launch_early
    import glm53.models.overlap as overlap
    from benchmarks import early_launch

    def now():
        return (launch_early.SMALL_KERNELS, fp8_act.UV_PDL, fp8_act.UV_PREFETCH, moe_fp8_triton.DOWN_PDL,
                moe_fp8_triton.DOWN_PREFETCH, overlap.SIDE_STREAM, fp8_act.UV_SPLITS_MAX_ROWS,
                overlap.INDEX_FIRST_MAX_ROWS, overlap.MAIN_PRIORITY)

    as_shipped = now()
    try:
        early_launch.switch("off")
        assert now() == early_launch.VARIANTS["off"] != as_shipped
        early_launch.switch("shipped")
        assert now() == as_shipped
    finally:
        for (module, attr), value in zip(early_launch.SWITCHES, as_shipped):
            setattr(importlib.import_module(module), attr, value)

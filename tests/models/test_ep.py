"""Expert parallelism's placement rule (`expert_parallel.expert_placement`) at GLM-5's shapes and
the errors that name what ep cannot split. The ranks themselves run in real gloo processes with
the tensor-parallel tests, which share their start-up: test_tp.py (ep = 2 at tp = 2, ep = 2 and 4
at tp = 4, against tp = 1 and transformers; dequantised block-FP8) and test_fp8_weights.py
(experts kept block-FP8 at tp = ep = 2)."""

from __future__ import annotations

import pytest

from glm53.models import ConfigError, GlmConfig, check_tp
from glm53.models.expert_parallel import expert_placement
from glm53.support.oracle import BASE
from tests.models.glm5_config import GLM5


def test_placement_at_glm5_shapes():
    cfg = GlmConfig.from_dict(GLM5)
    whole = expert_placement(cfg, tp=8, ep=8, rank=3)
    assert (whole.experts, whole.width_parts, whole.intermediate) == (range(96, 128), 1, 2048)
    assert whole.shapes(block=128) == {
        "gate_proj": (32, 2048, 6144), "gate_proj_scale_inv": (32, 16, 48),
        "up_proj": (32, 2048, 6144), "up_proj_scale_inv": (32, 16, 48),
        "down_proj": (32, 6144, 2048), "down_proj_scale_inv": (32, 48, 16)}
    mixed = expert_placement(cfg, tp=8, ep=2, rank=5)  # group 1 (ranks 4-7), width part 1 of 4
    assert (mixed.group, mixed.experts, mixed.width_part, mixed.intermediate) == (1, range(128, 256), 1, 512)
    assert (mixed.gate_up_shape, mixed.down_shape) == ((128, 512, 6144), (128, 6144, 512))
    tp_only = expert_placement(cfg, tp=8, ep=1, rank=7)
    assert (tp_only.experts, tp_only.width_part, tp_only.intermediate) == (range(256), 7, 256)
    # Every expert lives in exactly one group, every width part on one rank of it.
    held = [(e, p.width_part) for p in (expert_placement(cfg, 8, 4, r) for r in range(8)) for e in p.experts]
    assert sorted(held) == [(e, w) for e in range(256) for w in range(2)]


@pytest.mark.parametrize(
    "overrides, tp, ep, message",
    [
        ({}, 4, 3, "expert_parallel_size: ep=3 does not divide tensor_parallel_size=4"),
        ({}, 2, 0, "expert_parallel_size: must be an integer >= 1"),
        ({"n_routed_experts": 6}, 4, 4, "n_routed_experts: 6 is not divisible by expert_parallel_size=4"),
        ({"moe_intermediate_size": 33, "n_shared_experts": 4}, 4, 2,
         r"moe_intermediate_size: 33 is not divisible by tensor_parallel_size / expert_parallel_size = 4 / 2 = 2"),
        ({"moe_intermediate_size": 34}, 4, 4, r"shared experts' width .*: 34 is not divisible"),
    ],
)
def test_check_ep_names_the_field(overrides, tp, ep, message):
    with pytest.raises(ConfigError, match=message):
        check_tp(GlmConfig.from_dict({**BASE, **overrides}), tp, ep=ep)


def test_ep_relaxes_only_the_routed_width():
    # With ep = 4 each of 4 ranks holds whole experts, so tp = 4 need not divide their width of 34,
    # only the shared experts' (2 × 34 = 68).
    cfg = GlmConfig.from_dict({**BASE, "moe_intermediate_size": 34, "n_shared_experts": 2})
    check_tp(cfg, 4, ep=4)
    with pytest.raises(ConfigError, match="moe_intermediate_size: 34 is not divisible by tensor_parallel_size=4"):
        check_tp(cfg, 4, ep=1)

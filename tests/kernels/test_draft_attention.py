"""The paged draft attention's torch reference (the CPU serving path) against the formulation the
draft used before it (gather + cat + SDPA), and its shape checks. The Triton kernel itself runs
in test_interp_cases.py (interpreter) and test_gpu.py (H200)."""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.draft_attention import (
    attention_bias, draft_attention, draft_attention_gathered, draft_attention_reference, gather_context,
)

from . import draft_cases

SPANS = [(0, 80), (20, 70), (40, 41), (50, 50), (33, 64)]  # full, partial, one slot, empty, pages skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_against_old_formulation(dtype):
    torch.manual_seed(3)
    draft_cases.check_draft_attention(SPANS, [4, 2, 1, 3, 4], kv=2, group=3, block=4, hd=32, page_size=16,
                                      width=5, dtype=dtype)


def test_bad_shapes_are_clear_errors():
    x = draft_cases.make_inputs([(0, 8)], [2], kv=2, group=2, block=2, hd=16, page_size=8, width=1,
                                dtype=torch.float32)
    with pytest.raises(ValueError, match="mask"):
        draft_attention(x.q, x.pool, x.layer, x.table, x.k_blk, x.v_blk, x.mask[:, 1:])
    with pytest.raises(ValueError, match="pool"):
        draft_attention(x.q, x.pool, 5, x.table, x.k_blk, x.v_blk, x.mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_context_matches_the_reference(dtype):
    """The CPU drafting path: every layer's context gathered once, then attention per layer over
    that buffer, against the reference on a pool that is NaN wherever no request sees."""
    torch.manual_seed(5)
    x = draft_cases.make_inputs(SPANS, [4, 2, 1, 3, 4], kv=2, group=3, block=4, hd=32, page_size=16, width=5,
                                dtype=dtype, layers=3)
    buf = gather_context(x.pool_nan, x.table, x.mask, 4)
    assert buf.shape == (2, 3, 2, len(SPANS), 5 * 16 + 4, 32) and buf.dtype == torch.float32
    for layer in range(3):
        out = draft_attention_gathered(x.q, buf, layer, x.k_blk, x.v_blk, attention_bias(x.mask))
        ref = draft_attention_reference(x.q, x.pool_nan, layer, x.table, x.k_blk, x.v_blk, x.mask)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    with pytest.raises(ValueError, match="mask"):
        gather_context(x.pool_nan, x.table, x.mask[:, 1:], 4)

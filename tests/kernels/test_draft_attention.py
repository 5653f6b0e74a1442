"""The paged draft attention's torch reference (the CPU serving path) against the formulation the
draft used before it (gather + cat + SDPA), and its shape checks. The Triton kernel itself runs
in test_interp_cases.py (interpreter) and test_gpu.py (H200)."""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.draft_attention import draft_attention

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

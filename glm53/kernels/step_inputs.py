"""A decode step's per-row inputs derived from its positions and page table, in one op.

From each row's position p and page-table row, a decode step needs: the slot its KV is written to
(`page_table[p // page_size] * page_size + p % page_size`), that slot split into (page, offset)
for the paged stores, the context length p + 1, and the RoPE cos/sin of p. On the torch path that
is about a dozen launches (a division, a gather, casts, a remainder, adds, the frequencies' product,
a cos, a sin), each a few µs of a graph replay at one token; `step_inputs_triton` computes them all
in one. The results equal the torch ops' bit for bit: integer arithmetic, one fp32 product, and
cos/sin by the same CUDA math functions torch calls (`libdevice`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.kernels.dispatch import use_triton
from glm53.kernels.rope import rope_cos_sin


@dataclass(frozen=True)
class StepInputs:
    out_slots: torch.Tensor  # [N] long
    context_lens: torch.Tensor  # [N] int32
    page: torch.Tensor  # [N] long: out_slots // page_size
    offset: torch.Tensor  # [N] long: out_slots % page_size
    cos: torch.Tensor  # [N, rope / 2] fp32
    sin: torch.Tensor


def step_inputs(positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
                inv_freq: torch.Tensor) -> StepInputs:
    """positions [N] long (each within its row's pages), page_table [N, width] int32, inv_freq
    [rope / 2] fp32."""
    half = inv_freq.shape[0]
    if use_triton(positions, page_table) and half & (half - 1) == 0 and page_table.stride(1) == 1:
        from glm53.kernels.step_inputs_triton import step_inputs_triton

        return StepInputs(*step_inputs_triton(positions, page_table, page_size, inv_freq))
    return step_inputs_reference(positions, page_table, page_size, inv_freq)


def step_inputs_reference(positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
                          inv_freq: torch.Tensor) -> StepInputs:
    page = page_table.gather(1, (positions // page_size)[:, None]).squeeze(1).to(torch.long)
    slots = page * page_size + positions % page_size
    cos, sin = rope_cos_sin(positions, inv_freq)
    return StepInputs(slots, (positions + 1).to(torch.int32), slots // page_size, slots % page_size, cos, sin)

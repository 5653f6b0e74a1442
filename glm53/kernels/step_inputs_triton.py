"""`step_inputs.step_inputs` as one Triton kernel: a program per row. Compiled, cos/sin are
libdevice's (the CUDA math library's cosf/sinf, which torch's CUDA ops call); the interpreter has
no libdevice and runs `tl.cos`/`tl.sin` (numpy's)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import triton_interpreting
from glm53.kernels.rope_triton import cos_sin


@triton.jit
def _step_inputs_kernel(pos_ptr, table_ptr, inv_ptr, slot_ptr, len_ptr, page_ptr, off_ptr, cos_ptr, sin_ptr,
                        stride_t, PS: tl.constexpr, HALF: tl.constexpr, LIBDEVICE: tl.constexpr):
    i = tl.program_id(0)
    p = tl.load(pos_ptr + i)
    row_page = tl.load(table_ptr + i.to(tl.int64) * stride_t + p // PS).to(tl.int64)
    slot = row_page * PS + p % PS
    tl.store(slot_ptr + i, slot)
    tl.store(len_ptr + i, (p + 1).to(tl.int32))
    tl.store(page_ptr + i, slot // PS)
    tl.store(off_ptr + i, slot % PS)
    f = tl.arange(0, HALF)
    c, s = cos_sin(p.to(tl.float32) * tl.load(inv_ptr + f), LIBDEVICE)
    tl.store(cos_ptr + i * HALF + f, c)
    tl.store(sin_ptr + i * HALF + f, s)


def step_inputs_triton(positions: torch.Tensor, page_table: torch.Tensor, page_size: int, inv_freq: torch.Tensor):
    n, half = positions.shape[0], inv_freq.shape[0]
    dev = positions.device
    slots, page, off = (torch.empty(n, dtype=torch.long, device=dev) for _ in range(3))
    lens = torch.empty(n, dtype=torch.int32, device=dev)
    cos, sin = (torch.empty(n, half, dtype=torch.float32, device=dev) for _ in range(2))
    if n:
        _step_inputs_kernel[(n,)](positions, page_table, inv_freq, slots, lens, page, off, cos, sin,
                                  page_table.stride(0), PS=page_size, HALF=half, LIBDEVICE=not triton_interpreting(),
                                  num_warps=1)
    return slots, lens, page, off, cos, sin

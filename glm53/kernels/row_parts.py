"""A row sum not taken yet: rows [M, N] = Σ_s parts[s] in fp32, part 0 first, rounded once to
`dtype` (deterministic). A split-K product's partials (`fp8_split_k.sum_splits`) and an MoE's k
expert rows a token (`moe_triton.sum_slots`) are such sums. Where the next op is a norm that adds
them to the residual stream (`layers.norm_for`), it takes the sum in its own pass
(`norm_triton.load_residual_sum`) and the sum's launch goes away; a residual add with no norm
after it (a stage's last layer) takes it with `add_rows`; anything else takes `rows()`, the same
values in one launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm53.kernels.dispatch import tl_dtype, triton_interpreting, use_triton
from glm53.kernels.launch_early import early_args, wait_then_release


@dataclass(frozen=True)
class RowParts:
    parts: torch.Tensor  # [S, M, N] with a unit last stride (parts and rows any strides)
    dtype: torch.dtype  # the sum's

    def __post_init__(self):
        assert self.parts.dim() == 3 and self.parts.stride(2) == 1, (self.parts.shape, self.parts.stride())

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def rows(self) -> torch.Tensor:
        """The sum [M, N] in `dtype`: one launch where `dispatch.use_triton` says so, else the adds."""
        if use_triton(self.parts):
            return sum_parts_triton(self.parts, self.dtype)
        acc = self.parts[0].float()
        for p in self.parts[1:]:
            acc = acc + p.float()
        return acc.to(self.dtype)


def take(x: torch.Tensor | RowParts) -> torch.Tensor:
    """x itself, or the sum x defers."""
    return x.rows() if isinstance(x, RowParts) else x


def add_rows(x: torch.Tensor, a: torch.Tensor | RowParts) -> torch.Tensor:
    """x + a, rounded as torch's add rounds it (a's sum rounded to its dtype first, as `take`); a
    sum not taken yet is taken in the same launch where `dispatch.use_triton` says so."""
    if not isinstance(a, RowParts):
        return x + a
    if not use_triton(a.parts, x) or a.dtype != x.dtype or x.stride(-1) != 1:
        return x + a.rows()
    return sum_parts_triton(a.parts, a.dtype, base=x)


def row_source(x: torch.Tensor | RowParts) -> tuple[torch.Tensor, int, int, tl.dtype]:
    """What a kernel that reads rows x takes (`norm_triton.load_row`): the tensor its pointer and
    row strides come from, the parts (a tensor is one), the stride between parts, the rows' dtype."""
    if isinstance(x, RowParts):
        return x.parts[0], x.parts.shape[0], x.parts.stride(0), tl_dtype(x.dtype)
    return x, 1, 0, tl_dtype(x.dtype)


# M and, for a split-K product's partials, the stride between parts (M·N) follow the token count:
# not specialized, so no batch compiles a variant the warm-up did not (kernels/variants.py)
@triton.jit(do_not_specialize=["M", "stride_ps"])
def _sum_parts_kernel(p_ptr, y_ptr, b_ptr, M, N, stride_ps, stride_pm, stride_ym, stride_bm, S: tl.constexpr,
                      BLOCK: tl.constexpr, ADD: tl.constexpr = False, DT: tl.constexpr = tl.float32,
                      PDL: tl.constexpr = False):
    """ADD: y = b + the sum rounded to DT first (torch's `b + rows`), else the sum."""
    wait_then_release(PDL)  # launched early (launch_early.early_args): inputs first
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    row = p_ptr + m * stride_pm + n
    acc = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, S):
        acc += tl.load(row + s * stride_ps, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        acc = acc.to(DT).to(tl.float32) + tl.load(b_ptr + m * stride_bm + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def sum_parts_triton(parts: torch.Tensor, dtype: torch.dtype, base: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_s parts[s] in fp32, part 0 first, in `dtype`: one launch (the Triton launchers' own sums).
    `base` [M, N] in `dtype` (unit last stride): base + that sum instead, as torch adds them."""
    S, M, N = parts.shape
    # The interpreter's fp32 -> bf16 cast truncates (a GPU's rounds to nearest even): there the
    # kernel writes fp32 and torch casts (with `base`, the sum's rounding before the add is the
    # kernel's: exact in fp32 only).
    y = torch.empty((M, N), dtype=torch.float32 if triton_interpreting() else dtype, device=parts.device)
    if M and N:
        block = min(1024, triton.next_power_of_2(N))
        add = base is not None
        b = base if add else y
        _sum_parts_kernel[(M, triton.cdiv(N, block))](parts, y, b, M, N, parts.stride(0), parts.stride(1), y.stride(0),
                                                      b.stride(0), S=S, BLOCK=block, ADD=add, DT=tl_dtype(dtype),
                                                      num_warps=4 if block >= 512 else 1, **early_args())
    return y.to(dtype)

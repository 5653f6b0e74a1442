"""A token's cache row finished and stored in one op: the norm, the rotation and the paged write.

Both rows a layer caches are finished the same way before the store: MLA's latent row
[RMSNorm(c) | rope(k_pe)] and the DSA indexer's key [rope(LayerNorm(k))[:rope] | rest]. On the
torch path that is a norm, a rotation and an indexed store (the indexer's LayerNorm alone four
more: casts of x, weight, bias and the result), each a launch on a decode step of a few tokens;
`kv_rows_triton` does it in one. Only caches held in the row's dtype are fused: the FP8 layouts
quantize on their own store (`latent_cache_fp8`, `index_cache_fp8`).

Columns [0, norm_d) are normed (RMSNorm, or LayerNorm with a bias), then columns [rope_lo,
rope_lo + rope) rotated as `rope.apply_rope` does (normed values where they lie in the normed
part). The reference writes the finished row into x in place and then stores it; the kernel
stores only: callers must not read x afterwards.
"""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import use_triton
from glm53.kernels.norm import layer_norm, rms_norm
from glm53.kernels.rope import apply_rope
from glm53.kernels.row_parts import RowParts, take


def store_rows(x: torch.Tensor | RowParts, cache: torch.Tensor, coords: tuple[torch.Tensor, torch.Tensor],
               weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *, norm_d: int, rope_lo: int,
               interleave: bool, bias: torch.Tensor | None = None) -> None:
    """x [N, W] (unit last stride; rows may be strided; or a sum not taken yet, `row_parts`, which
    the kernel takes); cache [num_pages, page_size, W]; coords (page, offset) [N] of each row's
    slot; weight (and `bias`: LayerNorm) [norm_d]; cos/sin [N, rope / 2] fp32 with rope =
    cos.shape[1] * 2."""
    assert cache.dtype == x.dtype and cache.shape[-1] == x.shape[-1], (cache.dtype, cache.shape, x.dtype, x.shape)
    half = cos.shape[1]
    rows = x.parts if isinstance(x, RowParts) else x
    fits = rows.stride(-1) == 1 and half & (half - 1) == 0 and cos.stride(-1) == 1
    if fits and use_triton(rows, cache, weight):
        from glm53.kernels.kv_rows_triton import store_rows_triton

        return store_rows_triton(x, cache, coords, weight, bias, eps, cos, sin, norm_d, rope_lo, interleave)
    store_rows_reference(take(x), cache, coords, weight, eps, cos, sin, norm_d=norm_d, rope_lo=rope_lo,
                         interleave=interleave, bias=bias)


def finish_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
                norm_d: int, rope_lo: int, interleave: bool, bias: torch.Tensor | None = None) -> None:
    """The row finished in place, without the store: the norm, then the rotation (what the FP8
    caches' own stores take, and the reference's first two steps)."""
    normed = x[:, :norm_d]
    if bias is None:
        rms_norm(normed, weight, eps, out=normed)
    else:
        normed.copy_(layer_norm(normed, weight, bias, eps))
    part = x[:, rope_lo:rope_lo + 2 * cos.shape[1]]
    apply_rope(part, cos, sin, interleave, out=part)


def store_rows_reference(x: torch.Tensor, cache: torch.Tensor, coords: tuple[torch.Tensor, torch.Tensor],
                         weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *, norm_d: int,
                         rope_lo: int, interleave: bool, bias: torch.Tensor | None = None) -> None:
    """The three ops in turn, finishing x in place."""
    finish_rows(x, weight, eps, cos, sin, norm_d=norm_d, rope_lo=rope_lo, interleave=interleave, bias=bias)
    page, off = coords
    cache[page, off] = x

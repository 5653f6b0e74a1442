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
stores only: callers must not read x afterwards. A layer's two rows (latent and indexer key,
the same tokens and rotation angles) are stored in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.kernels.dispatch import use_triton
from glm53.kernels.norm import layer_norm, rms_norm
from glm53.kernels.rope import apply_rope
from glm53.kernels.row_parts import RowParts, take


@dataclass(frozen=True)
class CacheRow:
    """One row a token caches and how it is finished: x [N, W] (unit last stride; rows may be
    strided; or a sum not taken yet, `row_parts`, which the kernel takes) into cache [num_pages,
    page_size, W] of x's dtype; columns [0, norm_d) normed with weight (and `bias`: LayerNorm)
    [norm_d], columns [rope_lo, rope_lo + rope) rotated."""

    x: torch.Tensor | RowParts
    cache: torch.Tensor
    weight: torch.Tensor
    eps: float
    norm_d: int
    rope_lo: int
    interleave: bool
    bias: torch.Tensor | None = None


def store_rows(rows: list[CacheRow], coords: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
               sin: torch.Tensor) -> None:
    """Each of `rows` (one or two) finished and stored at coords (page, offset) [N] of each token's
    slot, in one launch; cos/sin [N, rope / 2] fp32 with rope = cos.shape[1] * 2, shared by the rows."""
    half = cos.shape[1]
    for r in rows:
        assert r.cache.dtype == r.x.dtype and r.cache.shape[-1] == r.x.shape[-1], (r.cache.dtype, r.cache.shape,
                                                                                    r.x.dtype, r.x.shape)
    sources = [r.x.parts if isinstance(r.x, RowParts) else r.x for r in rows]
    fits = all(x.stride(-1) == 1 for x in sources) and half & (half - 1) == 0 and cos.stride(-1) == 1
    if fits and use_triton(sources[0], *sources[1:], *(t for r in rows for t in (r.cache, r.weight))):
        from glm53.kernels.kv_rows_triton import store_rows_triton

        return store_rows_triton(rows, coords, cos, sin)
    for r in rows:
        store_rows_reference(take(r.x), r.cache, coords, r.weight, r.eps, cos, sin, norm_d=r.norm_d,
                             rope_lo=r.rope_lo, interleave=r.interleave, bias=r.bias)


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

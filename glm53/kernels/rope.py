"""Rotary position embedding on the rope slice of MLA queries/keys and indexer queries/keys.

GLM rotates interleaved pairs (x0, x1), (x2, x3), ... (GPT-J style) and writes the result
de-interleaved: [evens rotated | odds rotated], exactly as transformers' `GlmMoeDsa` does. Queries
and keys get the same permutation, so their dot products are those of the interleaved rotation.
`interleave=False` is the NeoX half-split form.

`apply_rope` runs the Triton kernel (`rope_triton.py`) where `dispatch.use_triton` says so, the
reference `apply_rope_reference` otherwise; with `out` (which may be x, in place) the result goes
there instead of a new tensor, which lets callers rotate a slice of a larger tensor without a cat.
"""

from __future__ import annotations

import torch

from glm53.kernels.dispatch import use_triton


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, rope_dim/2] in fp32 for integer positions [N]."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, ..., rope_dim]; cos/sin [N, rope_dim/2] fp32 (broadcast over the middle dims)."""
    half = x.shape[-1] // 2
    if use_triton(x) and x.dim() in (2, 3) and x.stride(-1) == 1 and half & (half - 1) == 0 and cos.stride(-1) == 1:
        from glm53.kernels.rope_triton import apply_rope_triton

        return apply_rope_triton(x, cos, sin, interleave, out)
    y = apply_rope_reference(x, cos, sin, interleave)
    return y if out is None else out.copy_(y)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """x [N, ..., rope_dim]; cos/sin [N, rope_dim/2] (broadcast over the middle dims)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c = cos.view(shape).to(x.dtype)
    s = sin.view(shape).to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

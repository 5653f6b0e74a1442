"""The FP8 indexer-key cache layout: 132 B per token for D = 128.

One page of one layer is `[page_size × D fp8 e4m3 | page_size × fp32 scale]`, so
`page_size * (D + 4)` bytes (8448 for the 64-token pages of GLM-5). A pool is page-major like the
bf16 pools, `[num_pages, n_layers, page_size * (D + 4)]` uint8, and a layer's cache is the strided
view `pool[:, j]` (`[num_pages, page_size * (D + 4)]`): every kernel takes strides.

Quantization (DeepSeek-V3.2 `act_quant`, ue8m0): one scale per token,
`scale = 2^ceil(log2(max(amax, 1e-4) / 448))`, `k_fp8 = clamp(k / scale, ±448)`. Callers rotate
keys (and queries) with the Hadamard transform (`hadamard`) before quantizing; `store` does not.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def hadamard(dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [dim, dim] (dim a power of two): `x @ H` rotates
    rows; applied to both keys and queries it leaves every q·k unchanged and spreads an outlier
    channel over all channels before the per-token FP8 scale is taken."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two width, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / dim**0.5).to(device=device, dtype=dtype)


def page_bytes(page_size: int, dim: int = 128) -> int:
    return page_size * (dim + 4)


def alloc_pool(num_pages: int, n_layers: int, page_size: int, dim: int = 128, device="cpu") -> torch.Tensor:
    """A page-major FP8 index-key pool [num_pages, n_layers, page_size * (dim + 4)] uint8."""
    return torch.zeros((num_pages, n_layers, page_bytes(page_size, dim)), dtype=torch.uint8, device=device)


def quantize(k: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """k [N, D] -> (fp8 e4m3 [N, D], fp32 scale [N])."""
    kf = k.float()
    amax = kf.abs().amax(dim=-1).clamp_min(1e-4)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (kf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def split_view(cache: torch.Tensor, dim: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's uint8 cache [num_pages, page_size*(dim+4)] -> (keys fp8 [num_pages, page_size, dim],
    scales fp32 [num_pages, page_size]), both strided views of the same bytes."""
    assert cache.dtype == torch.uint8 and cache.dim() == 2 and cache.stride(1) == 1
    num_pages, nbytes = cache.shape
    assert nbytes % (dim + 4) == 0, f"page bytes {nbytes} is not a multiple of {dim + 4}"
    page_size = nbytes // (dim + 4)
    keys = cache[:, : page_size * dim].view(torch.float8_e4m3fn).unflatten(1, (page_size, dim))
    scales = cache[:, page_size * dim :].view(torch.float32)
    return keys, scales


def store(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, ue8m0: bool = True,
          coords: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize keys k [N, D] and write them at physical slots [N] (page * page_size + offset);
    `coords` = (slots // page_size, slots % page_size) when the caller already has them."""
    dim = k.shape[-1]
    keys, scales = split_view(cache, dim)
    page_size = keys.shape[1]
    q, s = quantize(k, ue8m0)
    if coords is None:
        slots = slots.to(torch.long)
        coords = (slots // page_size, slots % page_size)
    keys[coords] = q
    scales[coords] = s


def dequantize(cache: torch.Tensor, dim: int = 128) -> torch.Tensor:
    """The whole layer cache as fp32 [num_pages, page_size, dim]."""
    keys, scales = split_view(cache, dim)
    return keys.float() * scales[..., None]

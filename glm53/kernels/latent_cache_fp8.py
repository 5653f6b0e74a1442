"""The FP8 MLA latent-cache layout (DeepSeek-V3.2 / FlashMLA "FP8 sparse"): 656 B per token for GLM-5.

One token's row, in byte order, for kv_lora_rank R and qk_rope_head_dim P:

    [0, R)                      R   fp8 e4m3 values of the latent c_kv (the "nope" part)
    [R, R + 4·NT)               NT  fp32 scales, scale i for latent columns [i·TILE, (i+1)·TILE)
    [R + 4·NT, R + 4·NT + 2·P)  P   bf16 values of the rotated k_pe (never quantized)

with TILE = 128 and NT = ceil(R / TILE); a latent narrower than 128 (the tiny test configs) is
one tile of its own width. GLM-5 (R 512, P 64): 512 + 4·4 + 2·64 = 656 bytes, FlashMLA's
`flash_mla_with_kvcache` FP8 format byte for byte (512 fp8, then 4 fp32 scales of 128-column
tiles, then 64 bf16). The layout needs R % 4 == 0 and P even (the fp32 and bf16 parts stay
aligned, and the row is a whole number of fp32 words).

A pool is page-major uint8 `[num_pages, n_layers, page_size, bytes_per_token]` (token-major
inside a page, as FlashMLA's `[blocks, page, 1, 656]`); a layer's cache is the strided view
`pool[:, j]` `[num_pages, page_size, bytes_per_token]`, and `views` reinterprets it without a copy
as fp8 / fp32 / bf16 tensors for kernels that take strides.

Quantization per tile: `scale = 2^ceil(log2(max(amax, 1e-4) / 448))` (ue8m0, a power of two, as
FlashMLA's V3.2 kernels and `index_cache_fp8` use), `c_fp8 = c / scale`. Why power-of-two
scales: multiplying by one is exact in every float format, so a kernel may fold the scale into
the scores (q·c·s) or the softmax weights (p·s before P·c) in bf16 without a rounding of its own,
and those kernels compute exactly "attention over the dequantized cache". The cost is range: the
largest value of a tile lands in [224, 448] instead of at 448, which moves the tile's smallest
values nearer e4m3's subnormals (relative precision elsewhere is the same in every binade).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0
TILE = 128
AMAX_MIN = 1e-4


@dataclass(frozen=True)
class LatentLayout:
    """Byte layout of one token's FP8 latent row for kv_lora_rank `rank` and rope width `rope`."""

    rank: int  # R: fp8 values
    rope: int  # P: bf16 values

    def __post_init__(self) -> None:
        if self.rank < 1 or self.rank % 4 or self.rope < 0 or self.rope % 2:
            raise ValueError(f"the FP8 latent layout needs kv_lora_rank % 4 == 0 and an even rope width, "
                             f"got {self.rank} and {self.rope}")

    @property
    def tile(self) -> int:
        return min(TILE, self.rank)

    @property
    def n_tiles(self) -> int:
        return -(-self.rank // self.tile)

    @property
    def scale_offset(self) -> int:
        return self.rank

    @property
    def rope_offset(self) -> int:
        return self.rank + 4 * self.n_tiles

    @property
    def bytes_per_token(self) -> int:
        return self.rope_offset + 2 * self.rope

    @classmethod
    def for_config(cls, cfg) -> "LatentLayout":
        return cls(cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def quantize(latent: torch.Tensor, layout: LatentLayout) -> torch.Tensor:
    """latent [N, R + P] (c_kv | k_pe, any float dtype) -> rows [N, bytes_per_token] uint8."""
    R, n = layout.rank, latent.shape[0]
    c = latent[:, :R].float()
    pad = layout.n_tiles * layout.tile - R
    tiles = torch.nn.functional.pad(c, (0, pad)).view(n, layout.n_tiles, layout.tile)
    amax = tiles.abs().amax(dim=-1).clamp_min(AMAX_MIN)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))  # [N, NT]
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(n, -1)[:, :R].to(torch.float8_e4m3fn)
    rope = latent[:, R:].to(torch.bfloat16)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8), rope.contiguous().view(torch.uint8)], dim=1)


def dequantize_rows(rows: torch.Tensor, layout: LatentLayout) -> torch.Tensor:
    """rows [..., bytes_per_token] uint8 (contiguous last dim) -> fp32 [..., R + P]."""
    R, T = layout.rank, layout.tile
    assert rows.dtype == torch.uint8 and rows.shape[-1] == layout.bytes_per_token, (rows.dtype, rows.shape)
    rows = rows.contiguous()
    c = rows[..., :R].view(torch.float8_e4m3fn).float()
    scale = rows[..., R : layout.rope_offset].view(torch.float32)  # [..., NT]
    col_scale = scale.repeat_interleave(T, dim=-1)[..., :R]
    rope = rows[..., layout.rope_offset :].view(torch.bfloat16).float()
    return torch.cat([c * col_scale, rope], dim=-1)


def store(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, layout: LatentLayout,
          coords: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize `latent` [N, R + P] and write the rows at physical slots [N] of one layer's cache
    [num_pages, page_size, bytes_per_token] uint8 (page * page_size + offset); `coords` =
    (slots // page_size, slots % page_size) when the caller already has them."""
    if coords is None:
        page_size = cache.shape[1]
        slots = slots.to(torch.long)
        coords = (slots // page_size, slots % page_size)
    cache[coords] = quantize(latent, layout)


def gather(cache: torch.Tensor, slots: torch.Tensor, layout: LatentLayout) -> torch.Tensor:
    """The dequantized fp32 rows [*slots.shape, R + P] of physical slots (all >= 0)."""
    page_size = cache.shape[1]
    slots = slots.to(torch.long)
    return dequantize_rows(cache[slots // page_size, slots % page_size], layout)


def views(cache: torch.Tensor, layout: LatentLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's uint8 cache [num_pages, page_size, bytes_per_token] (last dim contiguous) as
    (fp8 [num_pages, page_size, bpt], fp32 [num_pages, page_size, bpt / 4], bf16
    [num_pages, page_size, bpt / 2]): the same bytes, strides scaled to each element size. The
    latent is fp8 columns [0, R); scale i is fp32 column R/4 + i; the rope is bf16 columns
    rope_offset/2 + [0, P)."""
    assert cache.dtype == torch.uint8 and cache.dim() == 3 and cache.stride(2) == 1
    assert cache.shape[2] == layout.bytes_per_token, f"row of {cache.shape[2]} B, layout {layout.bytes_per_token}"
    return cache.view(torch.float8_e4m3fn), cache.view(torch.float32), cache.view(torch.bfloat16)

"""The FP8 latent-cache layout (kernels/latent_cache_fp8): byte order, the round-trip error bound
of e4m3 with power-of-two tile scales, and sparse MLA's reference over it (CPU, fast)."""

from __future__ import annotations

import torch

from glm53.kernels import index_cache_fp8, latent_cache_fp8 as L
from glm53.kernels.indexer_logits import indexer_logits_fp8_reference, indexer_logits_reference
from glm53.kernels.sparse_mla import sparse_mla_reference
from tests.kernels.cases import fp8_latent_pool


def test_layout_sizes_and_byte_order():
    glm5 = L.LatentLayout(512, 64)
    assert (glm5.tile, glm5.n_tiles, glm5.scale_offset, glm5.rope_offset, glm5.bytes_per_token) == (128, 4, 512, 528, 656)
    tiny = L.LatentLayout(96, 32)  # narrower than a tile: one tile of the whole latent
    assert (tiny.tile, tiny.n_tiles, tiny.bytes_per_token) == (96, 1, 164)
    assert L.LatentLayout(320, 64).n_tiles == 3  # a partial last tile
    torch.manual_seed(0)
    x = torch.randn(3, 576)
    row = L.quantize(x, glm5)
    assert row.shape == (3, 656) and row.dtype == torch.uint8
    scales = row[:, 512:528].contiguous().view(torch.float32)  # 4 fp32, one per 128 columns
    for i in range(4):
        tile = x[:, 128 * i : 128 * (i + 1)]
        want = torch.exp2(torch.ceil(torch.log2(tile.abs().amax(-1) / 448)))
        assert torch.equal(scales[:, i], want)
        q = row[:, 128 * i : 128 * (i + 1)].view(torch.float8_e4m3fn).float()
        assert torch.equal(q, (tile / want[:, None]).to(torch.float8_e4m3fn).float())
    assert torch.equal(row[:, 528:].contiguous().view(torch.bfloat16), x[:, 512:].bfloat16())
    for bad in ((98, 64), (96, 31)):
        try:
            L.LatentLayout(*bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


def test_round_trip_error_bound():
    """|x - dq(q(x))| <= 2^-4 |x| (e4m3's 3 mantissa bits, round to nearest) + scale * 2^-10 (half
    the subnormal spacing 2^-9), per element; the rope part within bf16's 2^-8 relative."""
    torch.manual_seed(1)
    for R, P in ((512, 64), (96, 32)):
        lay = L.LatentLayout(R, P)
        x = torch.randn(500, R + P) * 10 ** (4 * torch.rand(500, 1) - 2)
        x[:7, 3] *= 1e3  # outliers: a tile's small values fall to the subnormals
        y = L.dequantize_rows(L.quantize(x, lay), lay)
        scale = L.quantize(x, lay)[:, R : lay.rope_offset].contiguous().view(torch.float32)
        col_scale = scale.repeat_interleave(lay.tile, dim=1)[:, :R]
        err = (y[:, :R] - x[:, :R]).abs()
        assert torch.all(err <= x[:, :R].abs() * 2**-4 + col_scale * 2**-10)
        assert torch.all((y[:, R:] - x[:, R:]).abs() <= x[:, R:].abs() * 2**-8)
        # the bound is attained: e4m3 is no better than this
        assert (err / x[:, :R].abs().clamp_min(1e-30)).max() > 2**-5


def test_sparse_mla_reference_over_fp8_equals_attention_over_the_dequantized_cache():
    torch.manual_seed(2)
    R, P, ps = 96, 32, 16
    cache, dense = fp8_latent_pool(40, ps, R, P)
    q = torch.randn(3, 4, R + P)
    idx = torch.stack([torch.randperm(40 * ps)[:100] for _ in range(3)]).int()  # 100 of 640 slots
    idx[1, 50:] = -1
    out = sparse_mla_reference(q, cache, idx, 0.1, R)
    assert torch.equal(out, sparse_mla_reference(q, dense, idx, 0.1, R))


def test_indexer_fp8_reference_gathers_what_it_reads():
    """The FP8 indexer reference dequantizes only the keys each query sees: the same logits as the
    whole cache dequantized first."""
    torch.manual_seed(3)
    pool = index_cache_fp8.alloc_pool(12, 2, 16, 64)
    view = pool[:, 1]
    index_cache_fp8.store(view, torch.arange(12 * 16), torch.randn(12 * 16, 64))
    q, w = torch.randn(3, 4, 64), torch.randn(3, 4)
    pt = torch.stack([torch.randperm(12)[:8] for _ in range(3)]).int()
    lens = torch.tensor([128, 100, 77], dtype=torch.int32)
    got = indexer_logits_fp8_reference(q, w, view, pt, lens, 128)
    want = indexer_logits_reference(q, w, index_cache_fp8.dequantize(view, 64), pt, lens, 128)
    assert torch.equal(got, want)


def test_hadamard_is_orthonormal():
    h = index_cache_fp8.hadamard(128)
    assert torch.allclose(h @ h.T, torch.eye(128), atol=1e-6)

"""Paged KV cache: a page allocator that hands out contiguous extents, and named page-major pools.

All pools of a rank share one page-id space, so one page table (and one slot id) addresses
every pool. A pool is laid out page-major, [num_pages, n_layers, page_size, *per_token]: one
page of every layer the pool holds is one contiguous block, so a run of contiguous pages is one
contiguous byte range for the transfer layer, whose cost is per descriptor (docs/ARCHITECTURE.md,
"Buffer table and item lengths"). A layer's cache is the strided view pool[:, j]
([num_pages, page_size, *per_token]) and kernels address it with strides.

A head-sharded pool (tensor-parallel heads, e.g. the DFlash draft K/V) puts its heads axis
before the layers, [num_pages, heads_local, n_layers, page_size, head_dim], the layout the
transfer layer's `Heads` buffers have: a range of local heads is one contiguous part of a page
item, so prefill and decode with different TP sizes can exchange head ranges. Its per-layer view
is still [num_pages, page_size, heads_local, head_dim] (strided), so writers and readers treat
both kinds alike.

With an FP8 KV cache (`kv_dtype=torch.float8_e4m3fn`) the target pools hold bytes: `latent`
is uint8 `[num_pages, n_layers, page_size, 656]` for GLM-5 (the FlashMLA row of
`kernels/latent_cache_fp8`), `index_k` uint8 `[num_pages, n_layers, page_size, D + 4]` whose
page item per layer is `kernels/index_cache_fp8`'s `[page_size × D fp8 | page_size × fp32]` (the
token axis of that shape only counts bytes). Either way `bytes_per_token` is the real one, and
the transfer layer moves the bytes as they are. The DFlash draft's pool keeps the model dtype.

The allocator belongs to whoever schedules requests (the instance); ranks only own pools.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from glm53.kernels.latent_cache_fp8 import LatentLayout
from glm53.models.config import GlmConfig

# The target model's pool names (the transfer layer's buffer names too).
LATENT, INDEX_K = "latent", "index_k"


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Free pages kept as sorted, merged extents (start, length). `alloc` takes the smallest
    extent that fits the whole request (best fit, so a request is one run) and only splits the
    request over several extents, largest first, when no single extent is big enough."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages = num_pages
        self._starts: list[int] = [0]
        self._lens: list[int] = [num_pages]
        self._used = bytearray(num_pages)
        self.num_free = num_pages

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        pages: list[int] = []
        fits = [i for i, ln in enumerate(self._lens) if ln >= n]
        if fits:
            order = [min(fits, key=lambda i: self._lens[i])]
        else:
            order = sorted(range(len(self._lens)), key=lambda i: -self._lens[i])
        taken: list[tuple[int, int]] = []
        for i in order:
            take = min(self._lens[i], n - len(pages))
            pages.extend(range(self._starts[i], self._starts[i] + take))
            taken.append((i, take))
            if len(pages) == n:
                break
        for i, take in sorted(taken, reverse=True):
            if take == self._lens[i]:
                del self._starts[i], self._lens[i]
            else:
                self._starts[i] += take
                self._lens[i] -= take
        for p in pages:
            self._used[p] = 1
        self.num_free -= n
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or not self._used[p]:
                raise ValueError(f"page {p} is not allocated")
        if len(set(pages)) != len(pages):
            raise ValueError("a page is freed twice in one call")
        for p in pages:
            self._used[p] = 0
        for start, length in runs(sorted(pages)):
            self._insert(start, length)
        self.num_free += len(pages)

    def _insert(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:
            i -= 1
            self._lens[i] += length
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, length)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens[i + 1]
            del self._starts[i + 1], self._lens[i + 1]

    @property
    def extents(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lens))


def runs(pages: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs (start, length) of a page list, in its order."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


@dataclass(frozen=True, eq=False)
class Pool:
    """One named pool. Replicated (`total_heads` None): `tensor` is
    [num_pages, n_layers, page_size, *per_token]. Head-sharded: `tensor` is
    [num_pages, heads_local, n_layers, page_size, head_dim], `per_token` is (heads_local, head_dim)
    and `total_heads` counts the heads over all TP ranks. The layer axis holds the layers `layers`,
    in that order. `name`, `tensor`, `layers` and `total_heads` are what the transfer layer's
    `register_pool` takes."""

    name: str
    layers: tuple[int, ...]
    per_token: tuple[int, ...]
    tensor: torch.Tensor
    total_heads: int | None = None
    _pos: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pos", {layer: j for j, layer in enumerate(self.layers)})

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def index(self, layer: int) -> int:
        """Position of global layer `layer` on the layer axis."""
        try:
            return self._pos[layer]
        except KeyError:
            raise KeyError(f"pool {self.name!r} holds no layer {layer} (it holds {list(self.layers)})") from None

    @property
    def head_sharded(self) -> bool:
        return self.total_heads is not None

    def view(self, layer: int) -> torch.Tensor:
        """The strided per-layer cache [num_pages, page_size, *per_token] kernels address."""
        if self.head_sharded:
            return self.tensor[:, :, self.index(layer)].transpose(1, 2)
        return self.tensor[:, self.index(layer)]

    def bytes_per_page(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()


class KVPools:
    """Named page-major pools over one page-id space (same `num_pages` and `page_size`), so one
    page table and one slot id address every pool. Iterates as (name, pool) in registration
    order; the transfer layer registers each one by name."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        self._pools: dict[str, Pool] = {}

    def add(
        self,
        name: str,
        layers: Sequence[int],
        per_token: Sequence[int],
        dtype: torch.dtype,
        total_heads: int | None = None,
    ) -> Pool:
        """A replicated pool, or with `total_heads` a head-sharded one whose `per_token` is
        (heads_local, head_dim) (see `Pool`)."""
        if name in self._pools:
            raise ValueError(f"pool {name!r} is already registered")
        layers, per_token = tuple(layers), tuple(per_token)
        if len(set(layers)) != len(layers):
            raise ValueError(f"pool {name!r}: layer ids repeat: {list(layers)}")
        if total_heads is None:
            shape = (self.num_pages, len(layers), self.page_size, *per_token)
        else:
            if len(per_token) != 2 or total_heads % per_token[0]:
                raise ValueError(
                    f"pool {name!r}: a head-sharded pool needs per_token (heads_local, head_dim) with heads_local "
                    f"dividing total_heads={total_heads}, got {per_token}"
                )
            shape = (self.num_pages, per_token[0], len(layers), self.page_size, per_token[1])
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        pool = Pool(name, layers, per_token, tensor, total_heads)
        self._pools[name] = pool
        return pool

    def attach(self, name: str, pool: Pool) -> Pool:
        """Registers an existing pool's tensor under `name` too (same page ids: another
        container's view of it, e.g. the MTP layer addressing its pools by the target's names)."""
        if name in self._pools:
            raise ValueError(f"pool {name!r} is already registered")
        if pool.tensor.shape[0] != self.num_pages or pool.tensor.shape[-2 if pool.head_sharded else 2] != self.page_size:
            raise ValueError(f"pool {pool.name!r} does not have {self.num_pages} pages of {self.page_size} slots")
        self._pools[name] = dataclasses.replace(pool, name=name)
        return self._pools[name]

    def __getitem__(self, name: str) -> Pool:
        try:
            return self._pools[name]
        except KeyError:
            raise KeyError(f"no pool {name!r} (have {list(self._pools)})") from None

    def __contains__(self, name: str) -> bool:
        return name in self._pools

    def __iter__(self) -> Iterator[tuple[str, Pool]]:
        return iter(list(self._pools.items()))

    def __len__(self) -> int:
        return len(self._pools)

    def view(self, name: str, layer: int) -> torch.Tensor:
        return self[name].view(layer)

    def bytes_per_page(self) -> int:
        """Bytes one page costs summed over every pool (each pool counts all its layers)."""
        return sum(p.bytes_per_page() for p in self._pools.values())


FP8 = torch.float8_e4m3fn  # the `kv_dtype` that selects the FP8 layouts


def check_kv_dtype(kv_dtype: torch.dtype, dtype: torch.dtype) -> None:
    if kv_dtype not in (dtype, FP8):
        raise ValueError(f"a KV cache of {kv_dtype} for a {dtype} model: the cache holds the model dtype or FP8")


def target_pools(
    cfg: GlmConfig,
    layers: range,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_dtype: torch.dtype | None = None,
) -> KVPools:
    """The target model's pools for the stage holding `layers`: `latent` [c_kv | k_pe] on every
    layer, `index_k` on the stage's "full" indexer layers only (shared layers reuse another
    layer's top-k and own no keys; a stage without full layers gets no `index_k` pool).
    `kv_dtype` None or `dtype`: both in the model dtype; `FP8`: both in their FP8 byte layouts."""
    kv_dtype = kv_dtype or dtype
    check_kv_dtype(kv_dtype, dtype)
    pools = KVPools(num_pages, page_size, device)
    fp8 = kv_dtype == FP8
    latent = (LatentLayout.for_config(cfg).bytes_per_token,) if fp8 else (cfg.latent_dim,)
    pools.add(LATENT, layers, latent, torch.uint8 if fp8 else dtype)
    full = [i for i in cfg.full_layers if i in layers]
    if full:
        keys = (cfg.index_head_dim + 4,) if fp8 else (cfg.index_head_dim,)
        pools.add(INDEX_K, full, keys, torch.uint8 if fp8 else dtype)
    return pools


def kv_bytes_per_token(
    cfg: GlmConfig, dtype: torch.dtype, layers: range | None = None, kv_dtype: torch.dtype | None = None
) -> int:
    """KV bytes one token costs in the target pools of the stage holding `layers` (all by
    default); the same rule as `target_pools`, measured on meta tensors."""
    layers = layers if layers is not None else range(cfg.num_hidden_layers)
    return target_pools(cfg, layers, 1, 1, dtype, device="meta", kv_dtype=kv_dtype).bytes_per_page()

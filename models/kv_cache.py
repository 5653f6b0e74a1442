"""Paged KV cache: a page allocator that hands out contiguous extents, and page-major pools.

All pools of an instance share one page-id space. A pool is laid out page-major,
[num_pages, n_layers, page_size, dim]: one page of every layer the pool holds is one contiguous
block, so a run of contiguous pages is one contiguous byte range for the transfer layer (its
cost is per descriptor, DESIGN §4.4). A layer's cache is the strided view pool[:, j]
([num_pages, page_size, dim]) and kernels address it with strides.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


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


@dataclass(frozen=True)
class KVPoolSpec:
    num_pages: int
    page_size: int
    layers: tuple[int, ...]  # global ids of the layers this pool serves (a PP stage's)
    indexer_layers: tuple[int, ...]  # the "full" layers among them (own indexer-key cache)
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    index_dim: int  # index_head_dim
    dtype: torch.dtype


class KVPool:
    """The latent pool [P, n_layers, page_size, latent_dim] and the indexer-key pool
    [P, n_indexer_layers, page_size, index_dim] (full layers only; shared layers own none)."""

    def __init__(self, spec: KVPoolSpec, device: torch.device | str = "cpu"):
        self.spec = spec
        self._latent_pos = {layer: j for j, layer in enumerate(spec.layers)}
        self._index_pos = {layer: j for j, layer in enumerate(spec.indexer_layers)}
        shape = (spec.num_pages, len(spec.layers), spec.page_size, spec.latent_dim)
        self.latent = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.index_k = None
        if spec.indexer_layers:
            shape = (spec.num_pages, len(spec.indexer_layers), spec.page_size, spec.index_dim)
            self.index_k = torch.zeros(shape, dtype=spec.dtype, device=device)

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    def latent_view(self, layer: int) -> torch.Tensor:
        return self.latent[:, self._latent_pos[layer]]

    def index_view(self, layer: int) -> torch.Tensor:
        assert self.index_k is not None
        return self.index_k[:, self._index_pos[layer]]

    def buffers(self) -> dict[str, torch.Tensor]:
        """The pools by name, for the transfer layer's buffer table."""
        out = {"latent": self.latent}
        if self.index_k is not None:
            out["index_k"] = self.index_k
        return out

    @staticmethod
    def write(view: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        ps = view.shape[1]
        view[slots // ps, slots % ps] = values.to(view.dtype)

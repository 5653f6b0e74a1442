import random

import pytest
import torch

from glm53.models.kv_cache import KVPools, OutOfPages, PageAllocator, runs


def test_allocator_prefers_one_contiguous_extent():
    a = PageAllocator(100)
    x = a.alloc(10)
    assert x == list(range(10))
    y = a.alloc(5)
    a.free(x)
    z = a.alloc(8)  # best fit: the freed 10-page hole, not the tail
    assert runs(z) == [(0, 8)]
    assert a.num_free == 100 - 13
    a.free(y)
    a.free(z)
    assert a.extents == [(0, 100)]


def test_allocator_splits_only_when_no_extent_fits_and_never_leaks():
    a = PageAllocator(64)
    held = [a.alloc(1) for _ in range(64)]
    for h in held[::2]:
        a.free(h)
    got = a.alloc(10)
    assert len(set(got)) == 10 and a.num_free == 22
    with pytest.raises(OutOfPages):
        a.alloc(23)
    with pytest.raises(ValueError):
        a.free([got[0], got[0]])
    a.free(got)
    for h in held[1::2]:
        a.free(h)
    assert a.extents == [(0, 64)] and a.num_free == 64


def test_allocator_random_churn_keeps_invariants():
    rng = random.Random(0)
    a = PageAllocator(500)
    live: list[list[int]] = []
    for _ in range(2000):
        if live and (rng.random() < 0.5 or a.num_free < 50):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.alloc(rng.randint(1, 40)))
        used = [p for pg in live for p in pg]
        assert len(used) == len(set(used)) and a.num_free == 500 - len(used)
    for pg in live:
        a.free(pg)
    assert a.extents == [(0, 500)]


def test_pool_is_page_major_and_views_are_strided():
    pools = KVPools(num_pages=6, page_size=4)
    pools.add("latent", (3, 4, 5), (8,), torch.float32)
    pools.add("index_k", (3, 5), (5,), torch.float32)
    latent, index_k = pools["latent"].tensor, pools["index_k"].tensor
    assert latent.shape == (6, 3, 4, 8) and index_k.shape == (6, 2, 4, 5)
    v = pools.view("latent", 4)
    slots = torch.tensor([1, 9, 22])
    vals = torch.randn(3, 8)
    pools.write(v, slots, vals)
    assert torch.equal(latent[2, 1, 1], vals[1])  # slot 9 = page 2, offset 1, layer 4 -> index 1
    assert torch.equal(latent[5, 1, 2], vals[2])
    # One page of every layer is one contiguous block (what the transfer sends per page run).
    assert latent[2].is_contiguous() and latent[2:5].is_contiguous()

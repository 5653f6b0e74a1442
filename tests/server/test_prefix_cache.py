"""The prefill instance's prefix cache (engine/prefix_cache.py): the tree alone (matching, taking
pages, locks, eviction order, accounting), then the prefill scheduler with the real model: a prompt
that starts like an earlier one computes only its tail over the cached pages and must give the
same first token and the same KV as computing it all; every page is accounted for at the end."""

from __future__ import annotations

import pytest
import torch

from glm53.server.config_parse import parse_config
from glm53.server.engine.prefill import PrefillScheduler
from glm53.server.engine.prefix_cache import PrefixCache
from glm53.support.ports import free_ports
from tests.server.prefill_rooms import Sender, prefill

PS = 4


def toks(*runs):
    return [t for r in runs for t in r]


def test_match_takes_the_longest_cached_prefix_of_full_pages():
    c = PrefixCache(PS)
    a = list(range(10, 24))  # 3 full pages + 2 tokens
    _, lock = c.match(a, 3)
    assert c.insert(a, [7, 8, 9], lock) == {7, 8, 9}
    c.release(lock)
    assert (c.pages, c.evictable) == (3, 3)
    pages, lock = c.match(a, 3)
    assert pages == [7, 8, 9] and c.evictable == 0
    c.release(lock)
    pages, lock = c.match(a, 2)  # capped: the caller keeps tokens to compute
    assert pages == [7, 8]
    c.release(lock)
    pages, lock = c.match(toks(a[:4], [99] * 4, a[8:]), 3)  # diverges in page 2
    assert pages == [7]
    c.release(lock)
    assert c.match(a[:3], 3)[0] == []  # no full page
    assert c.evictable == 3


def test_insert_keeps_what_is_cached_and_locks_until_release():
    c = PrefixCache(PS)
    a, b = list(range(12)), toks(range(8), [50, 51, 52, 53])
    _, la = c.match(a, 2)
    assert c.insert(a, [1, 2, 3], la) == {1, 2, 3}
    pb, lb = c.match(b, 2)
    assert pb == [1, 2]
    # b computed its own copy of page 2 elsewhere: the cache takes only the new third page
    assert c.insert(b, [1, 2, 40], lb) == {40}
    assert c.evictable == 0
    assert c.evict(10) == []  # everything is locked
    c.release(la)
    assert c.evictable == 1 and c.evict(10) == [3]  # a's own leaf; b's path stays locked
    c.release(lb)
    assert sorted(c.evict(10)) == [1, 2, 40] and c.pages == 0


def test_salts_keep_separate_trees():
    c = PrefixCache(PS)
    t = list(range(12))
    _, lock = c.match(t, 3, salt="a")
    assert c.insert(t, [1, 2, 3], lock, salt="a") == {1, 2, 3}
    c.release(lock)
    assert c.match(t, 3)[0] == [] and c.match(t, 3, salt="b")[0] == []  # (empty locks: nothing to release)
    pages, lock = c.match(t, 3, salt="a")
    assert pages == [1, 2, 3]
    c.release(lock)
    _, lock = c.match(t, 3, salt="b")
    assert c.insert(t, [4, 5, 6], lock, salt="b") == {4, 5, 6}  # the same tokens, its own pages
    c.release(lock)
    assert c.pages == c.evictable == 6 and sorted(c.evict(6)) == [1, 2, 3, 4, 5, 6]


def test_eviction_is_leaves_first_least_recently_used_first():
    c = PrefixCache(PS)
    for i, pages in enumerate(([1, 2], [3, 4], [5, 6])):
        t = [100 * i + j for j in range(8)]
        _, lock = c.match(t, 2)
        c.insert(t, pages, lock)
        c.release(lock)
    _, lock = c.match([j for j in range(8)], 2)  # touch the first prompt
    c.release(lock)
    assert c.evict(1) == [4]  # the oldest leaf
    assert c.evict(2) == [3, 6]  # 3 is now a leaf and older than 6
    assert c.pages == 3 and c.evictable == 3
    assert sorted(c.clear()) == [1, 2, 5] and c.pages == c.evictable == 0


# -- the prefill scheduler with the real model -----------------------------------------------------
def scheduler(model_dir, cache: bool) -> PrefillScheduler:
    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": str(model_dir)},
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": 16, "num_pages": 40,
                     "chunked_prefill_size": 64, "disable_radix_cache": not cache},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })
    s = PrefillScheduler(cfg, cfg.prefill[0])
    s.senders = {}
    s.events = []
    s.workers.create_senders = lambda room, _name: s.senders.setdefault(room.id, Sender())
    s.channel.send = lambda _to, ev: s.events.append(ev)
    return s


def kv(s: PrefillScheduler, pages: list[int], n: int) -> dict[str, torch.Tensor]:
    """Every pool's rows of the first n positions in `pages` (pools are [page, layer, slot, ...];
    the partial last page's other slots were never written)."""
    out = {}
    for name, pool in s.workers.rank.runner.pools:
        t = pool.tensor[pages].transpose(1, 2)
        out[name] = t.reshape(-1, *t.shape[2:])[:n].clone()
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    base = torch.randint(10, 4000, (150,), generator=g).tolist()
    other = base[:100] + torch.randint(10, 4000, (70,), generator=g).tolist()  # shares 6 full pages
    return base, other


def test_prefill_over_cached_pages_equals_computing_everything(model_dir, prompts):
    base, other = prompts
    cold, warm = scheduler(model_dir, cache=False), scheduler(model_dir, cache=True)
    try:
        want, want_kv = {}, {}
        for k, p in ((1, base), (2, other)):  # read before a later request may reuse the pages
            want[k] = prefill(cold, k, p)
            want_kv[k] = kv(cold, want[k][1], len(p))
        first, first_pages = prefill(warm, 1, base)
        assert first == want[1][0]
        for room, prompt, shared in ((2, other, 6), (3, base, 9)):  # 9 = (150 - 1) // 16: one token computed
            first, pages = prefill(warm, room, prompt)
            assert first == want[{2: 2, 3: 1}[room]][0]
            assert pages[:shared] == first_pages[:shared]  # the cached pages themselves were sent
            assert len(pages) == -(-len(prompt) // 16) and len(set(pages)) == len(pages)
            got = kv(warm, pages, len(prompt))
            for name, t in want_kv[{2: 2, 3: 1}[room]].items():
                torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-5)
            ev = [e for e in warm.events if e.room == room and e.cached_tokens]
            assert [e.cached_tokens for e in ev] == [shared * 16]
        while warm.sending or warm.running:
            warm.step()
        # Every page is free or the cache's, and all of the cache's can be evicted.
        cache = warm.cache
        assert warm.allocator.num_free + cache.pages == warm.allocator.num_pages
        assert cache.evictable == cache.pages == 9 + 10 - 6 + 0  # base's 9 full pages, other's 4 more
        assert warm.load().kv_pages_used == 0
        warm.allocator.free(cache.evict(cache.pages))
        assert warm.allocator.num_free == warm.allocator.num_pages
        # No match at all without the cache.
        assert not [e for e in cold.events if e.cached_tokens]
    finally:
        cold.close()
        warm.close()


def test_cached_pages_are_evicted_for_a_request_that_needs_them(model_dir):
    s = scheduler(model_dir, cache=True)  # 40 pages of 16 tokens
    try:
        g = torch.Generator().manual_seed(9)
        for room in range(1, 6):  # 5 distinct prompts of 8 pages: the cache fills the pool
            prefill(s, room, torch.randint(10, 4000, (128,), generator=g).tolist())
            while s.sending:
                s.step()
        assert s.cache.pages + s.allocator.num_free == 40 and s.cache.pages >= 32
        assert s.load().kv_pages_used == 0  # cached pages count as available
        _, pages = prefill(s, 9, torch.randint(10, 4000, (300,), generator=g).tolist())  # 19 new pages
        assert len(pages) == len(set(pages)) == 19
        assert s.cache.pages <= 40 - 19 + 18  # cache pages were evicted to make room
        while s.sending:
            s.step()
        assert s.allocator.num_free + s.cache.pages == 40
    finally:
        s.close()

"""cache_aware routing (router/prefix_routing.py): the router's per-instance tree of the full
pages it sent there, and the pick between the longest cached prefix and the least loaded."""

from __future__ import annotations

import random

from glm53.server.router.prefix_routing import PrefixTree, pick_cache_aware


def test_match_counts_whole_pages_per_salt():
    t = PrefixTree(page_size=4, max_pages=100)
    ids = list(range(100, 111))  # 2 full pages + 3 tokens
    assert t.match(ids) == 0
    t.insert(ids)
    assert t.pages == 2
    assert t.match(ids) == 8 and t.match(ids + [1, 2, 3]) == 8
    assert t.match(ids[:7]) == 4  # a partial page is not cached
    assert t.match([100, 101, 102, 999] + ids[4:]) == 0
    assert t.match(ids, salt="other") == 0  # another salt's requests never share KV
    t.insert(ids[:4] + [7, 7, 7, 7, 8])
    assert t.pages == 3 and t.match(ids[:4] + [7, 7, 7, 7]) == 8


def test_eviction_drops_least_recently_used_leaves_first():
    t = PrefixTree(page_size=2, max_pages=10)
    rng = random.Random(0)
    old = [1, 1, 2, 2, 3, 3]
    t.insert(old)
    t.insert([9, 9])
    for _ in range(5):
        t.insert([rng.randrange(10, 1000) for _ in range(4)])  # 2 pages each, unrelated
        t.insert([9, 9])  # kept warm
    assert t.pages <= 10
    assert t.match([9, 9]) == 2
    assert t.match(old) < len(old)  # the oldest prefix went first (from its leaf)


def test_tree_size_stays_bounded_under_many_prompts():
    t = PrefixTree(page_size=4, max_pages=64)
    rng = random.Random(1)
    for _ in range(500):
        t.insert([rng.randrange(5000) for _ in range(rng.randrange(0, 40))], salt=rng.choice(["", "a"]))
        assert t.pages <= 64
    counted = 0
    stack = list(t.roots.values())
    while stack:
        x = stack.pop()
        counted += len(x.children)
        stack.extend(x.children.values())
    assert counted == t.pages


def test_pick_prefers_the_cached_prefix_while_balanced():
    # instance 1 holds 96 of 128 prompt tokens: it wins over the less loaded instance 0
    assert pick_cache_aware([0, 3], [0, 96], 128, 0.3, 64, 1.5) == 1
    # too little of the prompt cached anywhere: least loaded (None)
    assert pick_cache_aware([0, 3], [0, 16], 128, 0.3, 64, 1.5) is None
    assert pick_cache_aware([2, 2], [0, 0], 128, 0.3, 64, 1.5) is None
    # equal matches: the less loaded of them
    assert pick_cache_aware([5, 1, 9], [64, 64, 0], 100, 0.3, 64, 1.5) == 1
    # imbalanced beyond both thresholds: least loaded whatever is cached
    assert pick_cache_aware([0, 100], [0, 128], 128, 0.3, 64, 1.5) is None
    # a large absolute gap that is not a large ratio stays cache-first
    assert pick_cache_aware([200, 280], [0, 128], 128, 0.3, 64, 1.5) == 1

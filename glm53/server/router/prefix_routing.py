"""Cache-aware routing (`router.policy: cache_aware`): the router's approximate view of what each
prefill instance's prefix cache holds, and the choice it makes from it.

A prefill instance caches full KV pages keyed by their tokens (engine/prefix_cache.py, one tree
per cache salt). The router cannot see those trees, so it keeps its own per instance: the full
pages of every prompt it sent there, in a tree of page-sized token tuples, least recently used
pages evicted beyond `router.cache_max_pages` per instance, the whole tree dropped when the
instance goes down (a restarted instance starts empty). The view is approximate (the instance
evicts on its own), which costs at worst a miss, never a wrong answer.

The choice follows SGLang's model gateway: while the load is balanced, the instance that holds
the longest prefix wins if it holds at least `router.cache_threshold` of the prompt; otherwise
(or when the load is imbalanced by more than `balance_abs_threshold` requests and
`balance_rel_threshold` times) the least loaded instance.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class _Node:
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    parent: "_Node | None" = None
    key: tuple[int, ...] = ()
    used: int = 0  # a logical clock: higher is more recent


class PrefixTree:
    """The full pages of prompts sent to one instance, keyed by (cache salt, page tokens)."""

    def __init__(self, page_size: int, max_pages: int):
        self.page_size, self.max_pages = page_size, max_pages
        self.roots: dict[str, _Node] = {}
        self.pages = 0
        self._clock = itertools.count(1)

    def _pages(self, ids: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(ids[i:i + ps]) for i in range(0, len(ids) - ps + 1, ps)]

    def match(self, ids: Sequence[int], salt: str = "") -> int:
        """Tokens of `ids`' longest cached prefix (whole pages)."""
        node, n = self.roots.get(salt), 0
        for key in self._pages(ids) if node is not None else ():
            node = node.children.get(key)
            if node is None:
                break
            n += self.page_size
        return n

    def insert(self, ids: Sequence[int], salt: str = "") -> None:
        """Record that `ids`' full pages are cached there now (and recently used)."""
        now = next(self._clock)
        node = self.roots.setdefault(salt, _Node())
        for key in self._pages(ids):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(parent=node, key=key)
                self.pages += 1
            child.used = now
            node = child
        if self.pages > self.max_pages:  # down to 90%: one scan of the tree per many inserts
            self._evict(self.pages - self.max_pages * 9 // 10)

    def _evict(self, n: int) -> None:
        """Drop the `n` least recently used leaves (a leaf's parent becomes one in turn)."""
        leaves = [x for root in self.roots.values() for x in _leaves(root)]
        leaves.sort(key=lambda x: x.used)
        while n > 0 and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            del parent.children[leaf.key]
            self.pages -= 1
            n -= 1
            if parent.parent is not None and not parent.children:
                # Its parent is now a leaf, no newer than its child was: next in line.
                leaves.insert(0, parent)

    def clear(self) -> None:
        self.roots.clear()
        self.pages = 0


def _leaves(root: _Node) -> list[_Node]:
    out, stack = [], list(root.children.values())
    while stack:
        x = stack.pop()
        if x.children:
            stack.extend(x.children.values())
        else:
            out.append(x)
    return out


def pick_cache_aware(loads: Sequence[int], matched: Sequence[int], prompt_len: int, cache_threshold: float,
                     balance_abs: int, balance_rel: float) -> int | None:
    """The index of the instance to send a prompt to, or None for "the least loaded"."""
    hi, lo = max(loads), min(loads)
    if hi - lo > balance_abs and hi > balance_rel * lo:
        return None
    best = max(range(len(loads)), key=lambda i: (matched[i], -loads[i]))
    if matched[best] == 0 or matched[best] < cache_threshold * prompt_len:
        return None
    return best

"""Prefix cache of a prefill instance: full KV pages of earlier prompts, found again by their tokens.

A tree with one node per full page: a node's key is the page's `page_size` token ids, its path
from the root is the prompt prefix whose KV the page holds (causal attention: a position's KV,
indexer key and draft context depend only on the tokens up to it, so a page is valid for any
prompt that starts with its path). Every pool of every rank shares the instance's page ids, so one
page id stands for the latent, indexer-key and draft KV of those positions on every stage.

Ownership: a page in the tree belongs to the cache; the allocator counts it used. A request
`lock`s the path it matched (and, once inserted, its own pages) so that nothing it still reads —
its forward or its KV transfer — is evicted; `release` unlocks it, once, when the request's
transfer is terminal. Only unlocked nodes are evicted, leaves first, least recently used first.
The scheduler decides when; this module only keeps the tree consistent.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    locks: int = 0
    used: int = 0  # the cache's clock at the last match or insert through this node


@dataclass
class CacheLock:
    """The nodes one request holds locked (released once, by `PrefixCache.release`)."""

    nodes: list[_Node] = field(default_factory=list)


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._roots: dict[str, _Node] = {}  # one tree per cache salt: requests share only within one
        self._nodes = 0
        self._unlocked = 0  # nodes with no lock: what eviction can free
        self._clock = itertools.count(1)

    @property
    def pages(self) -> int:
        """Pages the cache holds."""
        return self._nodes

    @property
    def evictable(self) -> int:
        """Pages no request holds: free for the asking (`evict`)."""
        return self._unlocked

    def _keys(self, tokens: list[int], n_pages: int):
        ps = self.page_size
        return (tuple(tokens[i * ps : (i + 1) * ps]) for i in range(n_pages))

    def _root(self, salt: str) -> _Node:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = _Node((), -1, None)
        return root

    def match(self, tokens: list[int], max_pages: int, salt: str = "") -> tuple[list[int], CacheLock]:
        """The pages of the longest prefix of `tokens` cached under `salt` (at most `max_pages`
        full pages), locked for the caller."""
        node, pages, lock = self._roots.get(salt), [], CacheLock()
        if node is None:
            return pages, lock
        t = next(self._clock)
        for key in self._keys(tokens, min(max_pages, len(tokens) // self.page_size)):
            node = node.children.get(key)
            if node is None:
                break
            node.used = t
            pages.append(node.page)
            self._lock(node, lock)
        return pages, lock

    def insert(self, tokens: list[int], pages: list[int], lock: CacheLock, salt: str = "") -> set[int]:
        """Offer the request's full pages `pages` (page i holds tokens[i·ps : (i + 1)·ps]); the
        path is locked in `lock` (the request still reads it). Returns the pages the cache took:
        a page whose prefix is already cached (another request inserted it meanwhile, or it was
        matched) stays the caller's."""
        node, taken = self._root(salt), set()
        t = next(self._clock)
        held = {id(n) for n in lock.nodes}
        for key, page in zip(self._keys(tokens, len(pages)), pages):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, page, node)
                self._nodes += 1
                self._unlocked += 1
                taken.add(page)
            child.used = t
            if id(child) not in held:
                self._lock(child, lock)
                held.add(id(child))
            node = child
        return taken

    def release(self, lock: CacheLock) -> None:
        for node in lock.nodes:
            node.locks -= 1
            if node.locks == 0:
                self._unlocked += 1
        lock.nodes.clear()

    def evict(self, n: int) -> list[int]:
        """Up to `n` pages freed from unlocked nodes, leaves first, least recently used first;
        the caller returns them to the allocator."""
        freed: list[int] = []
        while len(freed) < n:
            leaves = sorted((x for x in self._walk() if not x.children and x.locks == 0), key=lambda x: x.used)
            if not leaves:
                break
            for leaf in leaves:
                if len(freed) >= n:
                    break
                # A parent left childless becomes a leaf in the next round: its clock is older anyway.
                del leaf.parent.children[leaf.key]
                self._nodes -= 1
                self._unlocked -= 1
                freed.append(leaf.page)
        return freed

    def clear(self) -> list[int]:
        """Every page of the tree, which empties, locks and all: for an instance that holds no
        request any more (its allocator starts over)."""
        pages = [x.page for x in self._walk()]
        self._roots.clear()
        self._nodes = self._unlocked = 0
        return pages

    def _lock(self, node: _Node, lock: CacheLock) -> None:
        if node.locks == 0:
            self._unlocked -= 1
        node.locks += 1
        lock.nodes.append(node)

    def _walk(self):
        stack = [x for root in self._roots.values() for x in root.children.values()]
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())

"""A page-granular radix tree over token ids: the prefix cache.

Each edge holds whole pages: a node's `key` is a run of token ids whose
length is a multiple of `page_size`, and `pages` the KV page ids that hold
them. Contracts:

- `match(tokens)` returns the longest cached prefix, in whole pages, and the
  node it ends at (splitting a node so the match ends on a node boundary).
  It takes no reference: call `lock(node)` to keep the pages from eviction.
- `lock(node)` / `unlock(node)` count references on the node and all its
  ancestors. A node with a reference is *protected*; one without is
  *evictable*. The cache's pages are always protected + evictable.
- `insert(tokens, pages)` adds a sequence whose KV lives in `pages`. Pages
  already cached for the same tokens under a different id are returned as
  duplicates: the caller still owns them and must free them.
- `evict(n)` removes least-recently-used unlocked leaves until `n` pages
  are freed or nothing evictable is left, and returns their page ids: the
  caller frees them. The cache never frees anything itself.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("parent", "children", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: "_Node | None", key: tuple[int, ...], pages: list[int], tick: int) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = tick


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ticks = itertools.count(1)
        self.root = _Node(None, (), [], 0)
        self.root.lock_ref = 1  # never evicted
        self.evictable_pages = 0
        self.protected_pages = 0

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    # ---------------------------------------------------------------- lookup
    def match(self, tokens: list[int] | tuple[int, ...]) -> tuple[list[int], _Node]:
        """Longest cached whole-page prefix of `tokens`: (page ids, end node)."""
        ps = self.page_size
        tick = next(self._ticks)
        node, pages, i = self.root, [], 0
        usable = len(tokens) - len(tokens) % ps
        while i < usable:
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = tick
            pages.extend(child.pages)
            node, i = child, i + n * ps
        return pages, node

    def lock(self, node: _Node) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise ValueError("radix node unlocked more times than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node = node.parent

    # ---------------------------------------------------------------- update
    def insert(self, tokens: list[int] | tuple[int, ...], pages: list[int]) -> list[int]:
        """Cache `tokens` (whole pages) held in `pages`; returns duplicate page ids."""
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"insert: {len(tokens)} tokens for {len(pages)} pages of {ps}")
        tick = next(self._ticks)
        node, i, duplicates = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                new = _Node(node, tuple(tokens[i:]), list(pages[i // ps :]), tick)
                node.children[new.key[:ps]] = new
                self.evictable_pages += len(new.pages)  # NOTE: a new leaf starts unlocked
                return duplicates
            n = self._common_pages(child.key, tokens, i)
            if n < len(child.pages):
                child = self._split(child, n)
            first = i // ps
            duplicates.extend(p for p, mine in zip(pages[first : first + n], child.pages) if p != mine)
            child.last_access = tick
            node, i = child, i + n * ps
        return duplicates

    def evict(self, num_pages: int) -> list[int]:
        """Free LRU unlocked leaves until `num_pages` pages are out; returns their ids."""
        if num_pages <= 0:
            return []
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            freed.extend(node.pages)
            self.evictable_pages -= len(node.pages)
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    # ------------------------------------------------------------- internals
    def _common_pages(self, key: tuple[int, ...], tokens, start: int) -> int:
        ps, n = self.page_size, 0
        limit = min(len(key), len(tokens) - start) // ps
        while n < limit and key[n * ps : (n + 1) * ps] == tuple(tokens[start + n * ps : start + (n + 1) * ps]):
            n += 1
        return n

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child` after `n` pages; returns the new upper node."""
        ps = self.page_size
        upper = _Node(child.parent, child.key[: n * ps], child.pages[:n], child.last_access)
        upper.lock_ref = child.lock_ref
        child.parent.children[upper.key[:ps]] = upper
        child.key, child.pages, child.parent = child.key[n * ps :], child.pages[n:], upper
        upper.children[child.key[:ps]] = child
        return upper

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

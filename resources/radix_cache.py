"""A page-granular radix tree over token ids: the prefix cache.

Each edge holds whole pages: a node's `key` is a run of token ids whose
length is a multiple of `page_size`, and `pages` the KV page ids (a numpy
int64 array) that hold them. Contracts:

- `match_pages(tokens)` returns the longest cached prefix, in whole pages,
  as a new int64 array, and the node it ends at (splitting a node so the
  match ends on a node boundary). It takes no reference: call `lock(node)`
  to keep the pages from eviction.
- `lock(node)` / `unlock(node)` count references on the node and all its
  ancestors. A node with a reference is *protected*; one without is
  *evictable*. The cache's pages are always protected + evictable.
- `insert_pages(tokens, pages)` adds a sequence whose KV lives in `pages`.
  Pages already cached for the same tokens under a different id are returned
  as duplicates (an int64 array): the caller still owns them and must free
  them.
- `evict_pages(n)` removes least-recently-used unlocked leaves until `n`
  pages are freed or nothing evictable is left, and returns their page ids:
  the caller frees them. The cache never frees anything itself.

`match`, `insert` and `evict` are the same calls with page ids as Python
lists (the KV hook's current form; the array forms skip the conversions).

`clear()` empties a cache with nothing locked and returns every page (the
caller frees them); `walk()` yields every node's (parent page, tokens,
pages), parents first.

Observer: with `observer` set (a `CacheObserver`), the cache reports each
page run that enters it (`stored(parent_page, tokens, pages)`, where
`parent_page` is the last page before the run or None at the root), each
eviction (`removed(pages)`) and `clear()` (`cleared()`), in the order they
happen, on the thread that changed the cache. Without one (the default)
nothing is reported and nothing is computed: one `is None` test per insert
that adds a node and per eviction call.

NOTE: eviction keeps a heap of the evictable leaves keyed by last access,
updated as nodes become or stop being evictable leaves, so an eviction costs
O(log n) per leaf instead of a walk of the whole tree; entries made stale by
a later access, a lock or a new child are skipped when they surface. Token
runs are compared as list slices (one C-level comparison per node on the
path), never page by page in Python.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

_NO_PAGES = np.empty(0, dtype=np.int64)


def _no_pages() -> np.ndarray:
    """A new empty array of page ids."""
    out: np.ndarray = _NO_PAGES.copy()
    return out


class CacheObserver(Protocol):
    """Told what enters and leaves the cache (engine.kv_events publishes it). Must not block, and must
    not change `tokens` or `pages` (the cache keeps them)."""

    def stored(self, parent_page: int | None, tokens: list[int], pages: np.ndarray) -> None: ...

    def removed(self, pages: np.ndarray) -> None: ...

    def cleared(self) -> None: ...


class _Node:
    __slots__ = ("parent", "children", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: _Node | None, key: list[int], pages: np.ndarray, tick: int) -> None:
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
        self._order = itertools.count()  # heap tie-break
        self.root = _Node(None, [], _NO_PAGES, 0)
        self.root.lock_ref = 1  # never evicted
        self.evictable_pages = 0
        self.protected_pages = 0
        #: (last access, order, node): the evictable leaves, and stale entries
        self._leaves: list[tuple[int, int, _Node]] = []
        self.observer: CacheObserver | None = None

    @property
    def total_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    # ---------------------------------------------------------------- lookup
    def match_pages(self, tokens: Sequence[int]) -> tuple[np.ndarray, _Node]:
        """Longest cached whole-page prefix of `tokens`: (page ids, end node)."""
        ps = self.page_size
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        tick = next(self._ticks)
        node, found, i = self.root, [], 0
        usable = len(tokens) - len(tokens) % ps
        while i < usable:
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i, usable)
            if n < child.pages.shape[0]:
                child = self._split(child, n)
            self._touch(child, tick)
            found.append(child.pages)
            node, i = child, i + n * ps
        if not found:
            return _no_pages(), node
        return (found[0].copy() if len(found) == 1 else np.concatenate(found)), node

    def match(self, tokens: Sequence[int]) -> tuple[list[int], _Node]:
        """`match_pages` with the page ids as a list."""
        pages, node = self.match_pages(tokens)
        return pages.tolist(), node

    def lock(self, node: _Node) -> None:
        cur: _Node | None = node
        while cur is not None:
            if cur.lock_ref == 0:
                n = cur.pages.shape[0]
                self.evictable_pages -= n
                self.protected_pages += n
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: _Node) -> None:
        cur: _Node | None = node
        while cur is not None:
            if cur.lock_ref <= 0:
                raise ValueError("radix node unlocked more times than locked")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                n = cur.pages.shape[0]
                self.evictable_pages += n
                self.protected_pages -= n
                if not cur.children:
                    self._push_leaf(cur)
            cur = cur.parent

    def path_pages(self, nodes: Sequence[_Node]) -> int:
        """Pages on the paths from `nodes` to the root, each node counted once (what a set
        of locks protects together; issue 21's sessions report it as kept)."""
        seen: set[int] = set()
        total = 0
        for node in nodes:
            cur: _Node | None = node
            while cur is not None and id(cur) not in seen:
                seen.add(id(cur))
                total += cur.pages.shape[0]
                cur = cur.parent
        return total

    # ---------------------------------------------------------------- update
    def insert_pages(self, tokens: Sequence[int], pages: np.ndarray | Sequence[int]) -> np.ndarray:
        """Cache `tokens` (whole pages) held in `pages`; returns duplicate page ids."""
        ps = self.page_size
        pages = np.asarray(pages, dtype=np.int64)
        if len(tokens) != pages.shape[0] * ps:
            raise ValueError(f"insert: {len(tokens)} tokens for {pages.shape[0]} pages of {ps}")
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        tick = next(self._ticks)
        node, i, duplicates = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                new = _Node(node, tokens[i:], pages[i // ps :].copy(), tick)
                node.children[tuple(tokens[i : i + ps])] = new
                self.evictable_pages += new.pages.shape[0]  # NOTE: a new leaf starts unlocked
                self._push_leaf(new)
                if self.observer is not None:
                    self.observer.stored(_last_page(node), new.key, new.pages)
                break
            n = self._common_pages(child.key, tokens, i, len(tokens))
            if n < child.pages.shape[0]:
                child = self._split(child, n)
            first = i // ps
            mine = pages[first : first + n]
            differ = mine != child.pages
            if differ.any():
                duplicates.append(mine[differ])
            self._touch(child, tick)
            node, i = child, i + n * ps
        if not duplicates:
            return _no_pages()
        out: np.ndarray = duplicates[0] if len(duplicates) == 1 else np.concatenate(duplicates)
        return out

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """`insert_pages` with the page ids as lists."""
        ids: list[int] = self.insert_pages(tokens, pages).tolist()
        return ids

    def evict_pages(self, num_pages: int) -> np.ndarray:
        """Free LRU unlocked leaves until `num_pages` pages are out; returns their ids."""
        freed: list[np.ndarray] = []
        count = 0
        heap = self._leaves
        while count < num_pages and heap:
            access, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or node.lock_ref or node.last_access != access:
                continue  # stale: evicted, grown a child, locked, or touched since it was pushed
            freed.append(node.pages)
            count += node.pages.shape[0]
            self.evictable_pages -= node.pages.shape[0]
            parent = node.parent
            del parent.children[tuple(node.key[: self.page_size])]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push_leaf(parent)
        if not freed:
            return _no_pages()
        out: np.ndarray = freed[0] if len(freed) == 1 else np.concatenate(freed)
        if self.observer is not None:
            self.observer.removed(out)
        return out

    def evict(self, num_pages: int) -> list[int]:
        """`evict_pages` with the page ids as a list."""
        ids: list[int] = self.evict_pages(num_pages).tolist()
        return ids

    def clear(self) -> np.ndarray:
        """Empty the cache and return all its pages (the caller frees them). Only with nothing locked:
        ValueError otherwise (a running request still reads its prefix)."""
        if self.protected_pages:
            raise ValueError(f"clear: {self.protected_pages} prefix-cache pages are locked by requests")
        pages = [pages for _, _, pages in self.walk()]
        self.root.children = {}
        self._leaves = []
        self.evictable_pages = 0
        if self.observer is not None:
            self.observer.cleared()
        return np.concatenate(pages) if pages else _no_pages()

    def walk(self) -> Iterator[tuple[int | None, list[int], np.ndarray]]:
        """Every node as (the page before it or None, its tokens, its pages), parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert node.parent is not None
            yield _last_page(node.parent), node.key, node.pages
            stack.extend(node.children.values())

    # ------------------------------------------------------------- internals
    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._leaves, (node.last_access, next(self._order), node))
        if len(self._leaves) > 64 and len(self._leaves) > 4 * (self.total_pages + 1):
            self._compact()

    def _touch(self, node: _Node, tick: int) -> None:
        node.last_access = tick
        if not node.children and node.lock_ref == 0:
            self._push_leaf(node)

    def _compact(self) -> None:
        """Drop the stale heap entries (each live node keeps its newest one)."""
        live = {}
        for access, order, node in self._leaves:
            if node.parent is not None and not node.children and not node.lock_ref and node.last_access == access:
                live[id(node)] = (access, order, node)
        self._leaves = list(live.values())
        heapq.heapify(self._leaves)

    def _common_pages(self, key: list[int], tokens: list[int], start: int, end: int) -> int:
        """Whole pages that `key` and ``tokens[start:end]`` share from their start."""
        ps = self.page_size
        limit = min(len(key), end - start) // ps
        if tokens[start : start + limit * ps] == key[: limit * ps]:
            return limit
        lo, hi = 1, limit  # the first page matches (it is the child's dict key); find the last that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens[start : start + mid * ps] == key[: mid * ps]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child` after `n` pages; returns the new upper node."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None, "the root is never split (a match starts below it)"
        upper = _Node(parent, child.key[: n * ps], child.pages[:n], child.last_access)
        upper.lock_ref = child.lock_ref
        parent.children[tuple(upper.key[:ps])] = upper
        child.key, child.pages, child.parent = child.key[n * ps :], child.pages[n:], upper
        upper.children[tuple(child.key[:ps])] = child
        return upper


def _last_page(node: _Node) -> int | None:
    """The last page of `node` (the parent page of its children), None for the root."""
    return int(node.pages[-1]) if node.pages.shape[0] else None

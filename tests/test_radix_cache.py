"""The radix prefix cache, by example and against a pure-Python model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from resources.radix_cache import RadixCache

PS = 2
TOKENS = st.lists(st.integers(0, 2), max_size=12)


def _make_cache(*seqs: tuple[list[int], list[int]], page_size: int = PS) -> RadixCache:
    cache = RadixCache(page_size)
    for tokens, pages in seqs:
        assert cache.insert(tokens, pages) == []
    return cache


def _assert_counts(cache: RadixCache, evictable: int, protected: int) -> None:
    assert (cache.evictable_pages, cache.protected_pages) == (evictable, protected)
    assert cache.total_pages == evictable + protected


class TestMatch:
    def test_empty_cache_matches_nothing(self):
        """Nothing cached: no pages, and the node is the root."""
        cache = RadixCache(PS)
        pages, node = cache.match([1, 2, 3, 4])
        assert pages == [] and node is cache.root

    def test_longest_whole_page_prefix(self):
        """Only whole pages match; a partial page at the end of the query is ignored."""
        cache = _make_cache(([1, 2, 3, 4, 5, 6], [10, 11, 12]))
        assert cache.match([1, 2, 3, 4, 5, 6, 7])[0] == [10, 11, 12]
        assert cache.match([1, 2, 3, 4, 5])[0] == [10, 11]
        assert cache.match([1, 2, 3, 9, 5, 6])[0] == [10]
        assert cache.match([2, 1])[0] == []

    def test_partial_match_splits_at_the_node_boundary(self):
        """A match ending inside a node splits it, so the node returned holds exactly the match."""
        cache = _make_cache(([1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13]))
        pages, node = cache.match([1, 2, 3, 4, 9, 9])
        assert pages == [10, 11] and node.pages == [10, 11]
        assert node.parent is cache.root and list(node.children.values())[0].pages == [12, 13]
        assert cache.match([1, 2, 3, 4, 5, 6, 7, 8])[0] == [10, 11, 12, 13]
        _assert_counts(cache, 4, 0)


class TestLocking:
    def test_lock_protects_and_unlock_restores(self):
        """A locked node and its ancestors are protected; unlocking makes them evictable again."""
        cache = _make_cache(([1, 1, 2, 2], [1, 2]), ([1, 1, 3, 3], [1, 3]))
        _, node = cache.match([1, 1, 3, 3])
        cache.lock(node)
        _assert_counts(cache, 1, 2)
        cache.lock(node)
        cache.unlock(node)
        _assert_counts(cache, 1, 2)
        cache.unlock(node)
        _assert_counts(cache, 3, 0)

    def test_unlock_more_than_lock_raises(self):
        """An unbalanced unlock is a bug and is refused."""
        cache = _make_cache(([1, 1], [5]))
        _, node = cache.match([1, 1])
        with pytest.raises(ValueError, match="unlocked more times than locked"):
            cache.unlock(node)


class TestInsert:
    def test_duplicates_are_returned_and_the_cache_keeps_its_pages(self):
        """Re-inserting cached tokens under other pages returns those pages to the caller."""
        cache = _make_cache(([1, 1, 2, 2], [1, 2]))
        assert cache.insert([1, 1, 2, 2, 3, 3], [7, 8, 9]) == [7, 8]
        assert cache.match([1, 1, 2, 2, 3, 3])[0] == [1, 2, 9]
        assert cache.insert([1, 1], [1]) == []
        _assert_counts(cache, 3, 0)

    @pytest.mark.parametrize(("tokens", "pages"), [([1, 2, 3], [1, 2]), ([1, 2], [1, 2]), ([1], [])])
    def test_tokens_must_fill_the_pages(self, tokens, pages):
        """Only whole pages can be cached."""
        with pytest.raises(ValueError, match="insert"):
            RadixCache(PS).insert(tokens, pages)


class TestEvict:
    def _make_three_leaves(self) -> RadixCache:
        cache = _make_cache(([1, 1, 2, 2], [1, 2]), ([1, 1, 3, 3], [1, 3]), ([4, 4], [4]))
        cache.match([1, 1, 3, 3])  # B is now the most recently used
        return cache

    def test_least_recently_used_leaves_go_first(self):
        """Leaves leave in LRU order, and a parent only once its children are gone."""
        cache = self._make_three_leaves()
        assert [cache.evict(1) for _ in range(5)] == [[2], [4], [3], [1], []]
        _assert_counts(cache, 0, 0)

    def test_locked_pages_are_never_evicted(self):
        """evict frees only unlocked pages, even when asked for more."""
        cache = self._make_three_leaves()
        _, node = cache.match([1, 1, 3, 3])
        cache.lock(node)
        assert sorted(cache.evict(10)) == [2, 4]
        _assert_counts(cache, 0, 2)
        cache.unlock(node)
        assert sorted(cache.evict(10)) == [1, 3]

    def test_evict_stops_once_enough_is_freed(self):
        """evict removes whole leaves until at least the asked number of pages is out."""
        cache = _make_cache(([1, 1, 2, 2, 3, 3], [1, 2, 3]), ([4, 4], [4]))
        assert cache.evict(2) == [1, 2, 3]
        assert cache.evict(0) == [] and cache.evict(-1) == []


class RadixModel(RuleBasedStateMachine):
    """match/lock/insert/unlock/evict against a dict of cached page prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(PS)
        self.entries: dict[tuple[int, ...], int] = {}  # whole-page prefix -> page id of its last page
        self.ticks: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[object, tuple[int, ...]]] = []
        self.clock = itertools.count(1)
        self.page_ids = itertools.count(1)

    def _longest(self, tokens) -> list[tuple[int, ...]]:
        out = []
        for end in range(PS, len(tokens) + 1, PS):
            key = tuple(tokens[:end])
            if key not in self.entries:
                break
            out.append(key)
        return out

    def _locked(self, key) -> bool:
        return any(prefix[: len(key)] == key for _, prefix in self.locks)

    def _is_leaf(self, key) -> bool:
        return not any(len(k) > len(key) and k[: len(key)] == key for k in self.entries)

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens, lock):
        pages, node = self.cache.match(tokens)
        keys = self._longest(tokens)
        assert pages == [self.entries[k] for k in keys]
        tick = next(self.clock)
        for k in keys:
            self.ticks[k] = tick
        if lock:
            self.cache.lock(node)
            self.locks.append((node, keys[-1] if keys else ()))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(tokens=TOKENS, reuse=st.booleans())
    def insert(self, tokens, reuse):
        tokens = tokens[: len(tokens) - len(tokens) % PS]
        keys = [tuple(tokens[:end]) for end in range(PS, len(tokens) + 1, PS)]
        cached = self._longest(tokens) if reuse else []
        pages = [self.entries[k] for k in cached] + [next(self.page_ids) for _ in keys[len(cached):]]
        expected_dups = [p for k, p in zip(keys, pages) if k in self.entries and self.entries[k] != p]
        assert self.cache.insert(tokens, pages) == expected_dups
        tick = next(self.clock)
        for k, p in zip(keys, pages):
            self.entries.setdefault(k, p)
            self.ticks[k] = tick

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        evictable = [k for k in self.entries if not self._locked(k)]
        page_key = {p: k for k, p in self.entries.items()}
        freed = self.cache.evict(n)
        gone = [page_key[p] for p in freed]
        assert len(set(freed)) == len(freed) and not any(self._locked(k) for k in gone)
        assert len(freed) >= n if len(evictable) >= n else len(freed) == len(evictable)
        for k in gone:
            del self.entries[k]
        remaining_leaves = [k for k in self.entries if self._is_leaf(k) and not self._locked(k)]
        if gone and remaining_leaves:  # LRU: nothing evicted is newer than a surviving unlocked leaf
            assert max(self.ticks[k] for k in gone) <= min(self.ticks[k] for k in remaining_leaves)
        for k in gone:
            del self.ticks[k]

    @invariant()
    def counts_match(self):
        locked = sum(1 for k in self.entries if self._locked(k))
        _assert_counts(self.cache, len(self.entries) - locked, locked)

    @invariant()
    def prefix_closed(self):
        assert all(k[:-PS] in self.entries for k in self.entries if len(k) > PS)


TestRadixModel = RadixModel.TestCase
TestRadixModel.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)

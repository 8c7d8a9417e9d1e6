"""The paged KV allocator, by example and against a pure-Python model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from resources.page_allocator import DoubleFree, ForeignPage, PageAllocator


def _snapshot(alloc: PageAllocator) -> tuple:
    """Everything an allocator call may change: the free stack and the in-use marks."""
    return (
        alloc.num_free,
        alloc._stack[: alloc.num_free].tolist(),
        [alloc.in_use(p) for p in range(alloc.num_pages)],
    )


def _assert_refused(alloc: PageAllocator, pages, exc: type[Exception]) -> None:
    before = _snapshot(alloc)
    with pytest.raises(exc):
        alloc.free(pages)
    assert _snapshot(alloc) == before


FORMS = ["int64", "int32", "2d", "numpy", "numpy-int32", "list"]


def _as_tensor(ids: list[int], form: str):
    """`ids` in one of the forms `free` accepts: tensors, numpy arrays, a list."""
    if form == "list":
        return list(ids)
    if form.startswith("numpy"):
        return np.array(ids, dtype=np.int32 if form == "numpy-int32" else np.int64)
    t = torch.tensor(ids, dtype=torch.int32 if form == "int32" else torch.int64)
    return t.reshape(1, -1) if form == "2d" else t


class TestAlloc:
    def test_fresh_allocator_hands_out_low_ids_first(self):
        """Single-page allocations come out as 1, 2, 3, ...; page 0 is never handed out."""
        alloc = PageAllocator(8, 16)
        assert [int(alloc.alloc(1)) for _ in range(7)] == [1, 2, 3, 4, 5, 6, 7]
        assert alloc.alloc(1) is None and alloc.num_free == 0

    def test_alloc_is_whole_or_nothing(self):
        """Asking for more than is free returns None and changes nothing."""
        alloc = PageAllocator(5, 16)
        pages = alloc.alloc(3)
        before = _snapshot(alloc)
        assert alloc.alloc(2) is None and _snapshot(alloc) == before
        assert sorted(alloc.alloc(1).tolist() + pages.tolist()) == [1, 2, 3, 4]

    @pytest.mark.parametrize("n", [0, -3])
    def test_alloc_nothing(self, n):
        """A non-positive request returns an empty int64 tensor."""
        pages = PageAllocator(4, 16).alloc(n)
        assert pages.dtype == torch.int64 and pages.numel() == 0

    def test_returned_tensor_is_the_callers(self):
        """Writing into the returned tensor cannot corrupt the free stack."""
        alloc = PageAllocator(6, 16)
        pages = alloc.alloc(3)
        ids = pages.tolist()
        pages.fill_(0)
        alloc.free(torch.tensor(ids))
        assert sorted(alloc.alloc(5).tolist()) == [1, 2, 3, 4, 5]

    def test_needs_a_usable_page(self):
        """Page 0 is reserved, so an allocator needs at least two pages."""
        with pytest.raises(ValueError, match="num_pages must be >= 2"):
            PageAllocator(1, 16)
        assert PageAllocator(2, 16).capacity == 1


class TestArrays:
    def test_alloc_array_hands_out_int64_arrays_the_caller_owns(self):
        """alloc_array returns a fresh int64 array; writing into it cannot corrupt the allocator."""
        alloc = PageAllocator(8, 16)
        pages = alloc.alloc_array(3)
        assert pages.dtype == np.int64 and pages.tolist() == [1, 2, 3]
        pages[:] = 0
        assert alloc.alloc_array(4).tolist() == [4, 5, 6, 7] and alloc.alloc_array(1) is None

    def test_pages_come_in_runs_and_go_back_in_order(self):
        """Fresh pages come out in ascending runs, and freed ones come back in the order they were
        given, so a request's pages stay runs of consecutive ids (a KV transfer's messages)."""
        alloc = PageAllocator(16, 4)
        a, b = alloc.alloc_array(5), alloc.alloc_array(4)
        assert a.tolist() == [1, 2, 3, 4, 5] and b.tolist() == [6, 7, 8, 9]
        alloc.free(a)
        alloc.free(b)
        assert alloc.alloc_array(4).tolist() == [6, 7, 8, 9]
        row = np.zeros(7, dtype=np.int64)
        assert alloc.alloc_into(row) and row.tolist() == [1, 2, 3, 4, 5, 10, 11]
        assert alloc.alloc_one() == 12

    def test_alloc_one_and_alloc_into(self):
        """alloc_one hands out one page as an int; alloc_into fills the caller's array; both all or nothing."""
        alloc = PageAllocator(5, 16)
        row = np.zeros(6, dtype=np.int64)
        assert alloc.alloc_into(row[:3]) and row[:3].tolist() == [1, 2, 3]
        page = alloc.alloc_one()
        assert type(page) is int and page == 4 and alloc.in_use(4)
        before = _snapshot(alloc)
        assert not alloc.alloc_into(row[3:5]) and alloc.alloc_one() is None and _snapshot(alloc) == before
        row[3] = page
        alloc.free(row[:4])
        assert alloc.num_free == 4

    def test_alloc_tensor_shares_the_array(self):
        """alloc's tensor is the same pages as an array would be (no copy needed to free it)."""
        alloc = PageAllocator(8, 16)
        pages = alloc.alloc(2)
        alloc.free(pages.numpy())
        assert alloc.num_free == 7

    def test_free_chunks_is_one_free_of_all_the_chunks(self):
        """free_chunks frees several arrays' pages at once and refuses a page repeated across chunks."""
        alloc = PageAllocator(10, 16)
        a, b, c = alloc.alloc_array(3), alloc.alloc_array(1), alloc.alloc_array(2)
        _assert_refused(alloc, np.concatenate([a, a[:1]]), DoubleFree)
        before = _snapshot(alloc)
        with pytest.raises(DoubleFree):
            alloc.free_chunks([a, b, a[:1]])
        assert _snapshot(alloc) == before
        alloc.free_chunks([a, b, c])
        assert alloc.num_free == 9


class TestFree:
    @pytest.mark.parametrize("form", FORMS)
    def test_free_accepts_any_integer_tensor(self, form):
        """Pages come back whatever integer dtype, shape or container they arrive in."""
        alloc = PageAllocator(10, 16)
        alloc.alloc(9)
        alloc.free(_as_tensor([4, 2, 9], form))
        alloc.free(_as_tensor([5], form))
        assert alloc.num_free == 4 and not alloc.in_use(4) and alloc.in_use(3)

    def test_empty_free_is_a_no_op(self):
        """Freeing no pages changes nothing."""
        alloc = PageAllocator(4, 16)
        alloc.alloc(2)
        before = _snapshot(alloc)
        alloc.free(torch.empty(0, dtype=torch.int64))
        assert _snapshot(alloc) == before

    @pytest.mark.parametrize(
        "ids", [[0], [-1], [10], [3, 0], [3, 10], [-100], [3, 4, -25], [3, -17], [-13, 4], [3, 2**62]], ids=str
    )
    def test_foreign_ids_raise_and_change_nothing(self, ids):
        """Page 0, negative ids and ids past the pool are refused before anything moves."""
        alloc = PageAllocator(10, 16)
        alloc.alloc(6)
        _assert_refused(alloc, torch.tensor(ids), ForeignPage)

    @pytest.mark.parametrize("ids", [[8], [2, 8], [8, 2], [2, 2], [3, 4, 3], [2] * 7, [5] * 40], ids=str)
    def test_double_free_raises_and_changes_nothing(self, ids):
        """A free page, or a page named twice in one call, is refused atomically."""
        alloc = PageAllocator(10, 16)
        alloc.alloc(6)  # pages 1..6 in use, 7..9 free
        _assert_refused(alloc, torch.tensor(ids), DoubleFree)

    def test_second_free_of_the_same_pages_raises(self):
        """Freeing an allocation twice is caught; the first free stands."""
        alloc = PageAllocator(10, 16)
        pages = alloc.alloc(3)
        alloc.free(pages)
        _assert_refused(alloc, pages, DoubleFree)
        assert alloc.num_free == 9

    def test_reserved_page_counts_as_in_use(self):
        """`in_use(0)` is true: the padding page is never free."""
        assert PageAllocator(4, 16).in_use(0)


class AllocatorModel(RuleBasedStateMachine):
    """Random alloc/free, double frees and foreign ids against sets of free and held pages."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: PageAllocator | None = None

    @precondition(lambda self: self.alloc is None)
    @rule(num_pages=st.integers(2, 40))
    def create(self, num_pages):
        self.alloc = PageAllocator(num_pages, 4)
        self.free = set(range(1, num_pages))
        self.held: set[int] = set()

    @precondition(lambda self: self.alloc is not None)
    @rule(n=st.integers(-1, 12), how=st.sampled_from(["alloc", "alloc_array", "alloc_into", "alloc_one"]))
    def allocate(self, n, how):
        before = _snapshot(self.alloc)
        if how == "alloc_one":
            n = 1
            page = self.alloc.alloc_one()
            pages = None if page is None else [page]
        elif how == "alloc_into":
            n = max(n, 0)
            out = np.zeros(n, dtype=np.int64)
            pages = out if self.alloc.alloc_into(out) else None
        else:
            pages = getattr(self.alloc, how)(n)
        if n > len(self.free):
            assert pages is None and _snapshot(self.alloc) == before
            return
        ids = list(pages) if how == "alloc_one" else pages.tolist()
        assert len(ids) == max(n, 0) == len(set(ids)) and set(ids) <= self.free
        self.free -= set(ids)
        self.held |= set(ids)

    @precondition(lambda self: self.alloc is not None and self.held)
    @rule(data=st.data(), form=st.sampled_from(FORMS))
    def free_held(self, data, form):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        self.alloc.free(_as_tensor(ids, form))
        self.held -= set(ids)
        self.free |= set(ids)

    @precondition(lambda self: self.alloc is not None and self.free)
    @rule(data=st.data())
    def double_free(self, data):
        bad = data.draw(st.lists(st.sampled_from(sorted(self.free)), min_size=1, max_size=3, unique=True))
        held = st.sampled_from(sorted(self.held)) if self.held else st.nothing()
        good = data.draw(st.lists(held, max_size=3 if self.held else 0, unique=True))
        ids = data.draw(st.permutations(bad + good))
        _assert_refused(self.alloc, _as_tensor(ids, data.draw(st.sampled_from(FORMS))), DoubleFree)

    @precondition(lambda self: self.alloc is not None and self.held)
    @rule(data=st.data(), times=st.integers(2, 50))
    def repeated_id(self, data, times):
        page = data.draw(st.sampled_from(sorted(self.held)))
        others = data.draw(st.lists(st.sampled_from(sorted(self.held)), max_size=3, unique=True))
        ids = data.draw(st.permutations([page] * times + [p for p in others if p != page]))
        _assert_refused(self.alloc, _as_tensor(ids, data.draw(st.sampled_from(FORMS))), DoubleFree)

    @precondition(lambda self: self.alloc is not None)
    @rule(data=st.data())
    def foreign_id(self, data):
        n = self.alloc.num_pages
        far = st.sampled_from([-(2**62), 2**62])
        bad = data.draw(st.one_of(st.integers(-3 * n, 0), st.integers(n, 3 * n), far))
        others = data.draw(st.lists(st.sampled_from(sorted(self.held | self.free)), max_size=3))
        ids = data.draw(st.permutations([bad, *others]))
        _assert_refused(self.alloc, torch.tensor(ids), ForeignPage)

    @invariant()
    def matches_model(self):
        if self.alloc is None:
            return
        assert self.alloc.num_free == len(self.free)
        assert self.alloc.num_free + len(self.held) == self.alloc.capacity
        assert set(self.alloc._stack[: self.alloc.num_free].tolist()) == self.free
        assert [p for p in range(self.alloc.num_pages) if self.alloc.in_use(p)] == sorted({0} | self.held)


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)

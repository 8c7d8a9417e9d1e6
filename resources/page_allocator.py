"""The paged KV allocator: which pages of the KV buffers are free.

Free page ids live in an int64 array used as a stack; a boolean array marks
the pages held by callers, so a double free or a foreign id is caught before
anything changes. Allocation succeeds whole or changes nothing.

API (pages are numpy int64 arrays end to end; no call allocates a tensor)::

    alloc_array(n) -> np.ndarray | None   n fresh page ids the caller owns
    alloc_into(out) -> bool               fill `out` (e.g. a row of the caller's
                                          host page table) with fresh page ids
    alloc_one() -> int | None             one page (decode growth), a Python int
    free(pages)                           pages: np.ndarray, CPU tensor (read
                                          in place) or a sequence of ints
    free_chunks([a, b, ...])              one free of several arrays' pages
    alloc(n) -> torch.Tensor | None       alloc_array as a tensor sharing its
                                          memory (for callers that want one)

NOTE: this is bookkeeping, kept in host memory on every device (a CUDA
allocator that asked the GPU whether a page is free would synchronise on
every call). The page ids it hands out index the KV buffers, which live on
the configured device. Page 0 is reserved as the padding page.

NOTE: every call is a handful of numpy operations on small arrays (well
under a microsecond each, where a torch op costs a few), and one-page calls,
the commonest in decoding, are plain Python on the arrays' items.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


_INT64 = np.dtype(np.int64)


class DoubleFree(Exception):
    """A page was freed that is not in use."""


class ForeignPage(Exception):
    """A page id that this allocator never hands out."""


class PageAllocator:
    """Stack of free page ids over pages 1..num_pages-1."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.capacity = num_pages - 1
        # lowest ids on top so a fresh allocator hands out 1, 2, 3, ... An allocation takes the top
        # `n` in popping order (ascending ids on a fresh allocator) and a free pushes its ids so
        # they pop again in the order given: a request's pages stay runs of consecutive ids, so a
        # KV transfer moves them in few messages (engine.disagg.link.messages)
        self._stack = np.arange(num_pages - 1, 0, -1, dtype=np.int64)
        self._top = self.capacity  # number of free pages
        # NOTE: tag 0: held by a caller; negative: free (a freed page keeps the
        # stamp -1 - its position in the free that returned it). Page 0 is reserved,
        # never handed out, never held, and one padding entry past the end stays
        # -1 too: a clipped lookup sends every negative id to page 0 and every id
        # past the pool to the padding, so any foreign id reads "not held".
        self._tag = np.full(num_pages + 1, -1, dtype=np.int64)
        self._neg_iota = -1 - np.arange(num_pages, dtype=np.int64)

    @property
    def num_free(self) -> int:
        return self._top

    def alloc_array(self, n: int) -> np.ndarray | None:
        """Take `n` pages (a new int64 array), or return None and change nothing if fewer are free."""
        top = self._top - n
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if top < 0:
            return None
        ids: np.ndarray = self._stack[top : self._top][::-1].copy()  # NOTE: popping order: see _stack
        if n == 1:
            self._tag[ids.item()] = 0
        else:
            self._tag[ids] = 0
        self._top = top
        return ids

    def alloc_into(self, out: np.ndarray) -> bool:
        """Fill the int64 array `out` with ``len(out)`` fresh page ids; False
        (changing nothing) if fewer are free. No array is allocated."""
        n = out.shape[0]
        top = self._top - n
        if top < 0:
            return False
        if n == 1:
            page = self._stack[top]
            out[0] = page
            self._tag[page] = 0
        elif n:
            out[:] = self._stack[top : self._top][::-1]
            self._tag[out] = 0
        self._top = top
        return True

    def alloc_one(self) -> int | None:
        """One fresh page id, or None if none is free."""
        top = self._top - 1
        if top < 0:
            return None
        page = int(self._stack[top])
        self._tag[page] = 0
        self._top = top
        return page

    def alloc(self, n: int) -> torch.Tensor | None:
        """`alloc_array` as an int64 tensor sharing the array's memory."""
        ids = self.alloc_array(n)
        return None if ids is None else torch.from_numpy(ids)

    def free(self, pages: np.ndarray | torch.Tensor | Sequence[int]) -> None:
        """Give pages back; raises (changing nothing) on a foreign id or a double free."""
        if type(pages) is np.ndarray:
            ids = pages if pages.dtype is _INT64 and pages.ndim == 1 else pages.astype(np.int64).reshape(-1)
        elif isinstance(pages, torch.Tensor):
            t = pages.detach()
            if not t.is_cpu or t.dtype is not torch.int64 or t.dim() != 1:
                t = t.reshape(-1).to(dtype=torch.int64, device="cpu")
            ids = t.numpy()
        else:
            ids = np.asarray(pages, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            return
        tag = self._tag
        if n == 1:
            page = ids.item()
            if not 0 < page < self.num_pages:
                raise ForeignPage(f"page id out of range 1..{self.num_pages - 1}: {page}")
            if tag[page] < 0:
                raise DoubleFree(f"freeing pages not in use: [{page}]")
            tag[page] = -1
            self._stack[self._top] = page
            self._top += 1
            return
        if n > self.capacity - self._top:  # more pages than are held: some repeat or are free
            self._raise_for(ids)
        held = tag.take(ids, mode="clip")
        if np.count_nonzero(held):  # NOTE: a held page's tag is exactly 0
            self._raise_for(ids)
        stamp = self._neg_iota[:n]
        tag[ids] = stamp  # free now; a repeated id keeps only its last position's stamp
        if np.count_nonzero(tag[ids] != stamp):
            tag[ids] = held  # undo: every id was held
            raise DoubleFree(f"page ids repeated within one free: {ids.tolist()}")
        self._stack[self._top : self._top + n] = ids[::-1]
        self._top += n

    def free_chunks(self, chunks: Sequence[np.ndarray]) -> None:
        """Free the pages of several arrays (a request's page lists) in one call."""
        self.free(chunks[0] if len(chunks) == 1 else np.concatenate(chunks))

    def in_use(self, page: int) -> bool:
        """Whether `page` is held by a caller (the reserved page 0 always is)."""
        return page == 0 or not self._tag[page]

    def free_pages(self) -> np.ndarray:
        """The free page ids (a copy), top of the stack last."""
        ids: np.ndarray = self._stack[: self._top].copy()
        return ids

    def _raise_for(self, ids: np.ndarray) -> None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 1 or hi >= self.num_pages:
            raise ForeignPage(f"page id out of range 1..{self.num_pages - 1}: {lo if lo < 1 else hi}")
        not_held = ids[self._tag[ids] < 0]
        if not_held.size:
            raise DoubleFree(f"freeing pages not in use: {not_held.tolist()}")
        raise DoubleFree(f"page ids repeated within one free: {ids.tolist()}")

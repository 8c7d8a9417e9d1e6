"""The paged KV allocator: which pages of the KV buffers are free.

Free page ids live in a tensor used as a stack; a boolean tensor marks the
pages in use, so a double free or a foreign id is caught before anything
changes. Allocation succeeds whole or changes nothing.

NOTE: this is bookkeeping, kept in host memory on every device (a CUDA
allocator that asked the GPU whether a page is free would synchronise on
every call). The page ids it hands out index the KV buffers, which live on
the configured device. Page 0 is reserved as the padding page.
"""

from __future__ import annotations

import torch


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
        # lowest ids on top so a fresh allocator hands out 1, 2, 3, ...
        self._stack = torch.arange(num_pages - 1, 0, -1, dtype=torch.int64)
        self._top = self.capacity  # number of free pages
        self._in_use = torch.zeros(num_pages, dtype=torch.bool)
        self._in_use[0] = True  # reserved, never free

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` pages, or return None and change nothing if fewer are free."""
        if n <= 0:
            return _EMPTY
        if n > self._top:
            return None
        self._top -= n
        pages = self._stack[self._top : self._top + n].clone()
        self._in_use[pages] = True
        return pages

    def free(self, pages: torch.Tensor) -> None:
        """Give pages back; raises (changing nothing) on a foreign id or a double free."""
        n = pages.numel()
        if n == 0:
            return
        pages = pages.reshape(-1).to(dtype=torch.int64, device="cpu")
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi >= self.num_pages:
            raise ForeignPage(f"page id out of range 1..{self.num_pages - 1}: {lo if lo < 1 else hi}")
        if not bool(self._in_use[pages].all()):
            raise DoubleFree(f"freeing pages not in use: {pages[~self._in_use[pages]].tolist()}")
        if n > 1 and torch.unique(pages).numel() != n:
            raise DoubleFree(f"page ids repeated within one free: {pages.tolist()}")
        self._in_use[pages] = False
        self._stack[self._top : self._top + n] = pages
        self._top += n

    def in_use(self, page: int) -> bool:
        return bool(self._in_use[page])


_EMPTY = torch.empty(0, dtype=torch.int64)

"""The paged KV allocator: which pages of the KV buffers are free.

Free page ids live in a tensor used as a stack; a boolean tensor marks the
pages held by callers, so a double free or a foreign id is caught before
anything changes. Allocation succeeds whole or changes nothing.

NOTE: this is bookkeeping, kept in host memory on every device (a CUDA
allocator that asked the GPU whether a page is free would synchronise on
every call). The page ids it hands out index the KV buffers, which live on
the configured device. Page 0 is reserved as the padding page.

NOTE: both tensors are read and written through numpy views of the same
memory: a numpy op on a small array costs well under a microsecond, a torch
op a few, and an allocator call is a handful of them.
"""

from __future__ import annotations

import numpy as np
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
        # NOTE: held by a caller; page 0 is reserved, never handed out, never held.
        # One padding entry past the end stays False: a clipped lookup sends every
        # negative id to page 0 and every id past the pool to the padding, so any
        # foreign id reads "not held".
        self._held = torch.zeros(num_pages + 1, dtype=torch.bool)
        self._in_use = self._held[:num_pages]
        self._stack_np = self._stack.numpy()
        self._held_np = self._held.numpy()
        self._in_use_np = self._held_np[:num_pages]
        self._stamp = np.zeros(num_pages, dtype=np.int32)  # scratch for the duplicate check
        self._iota = np.arange(num_pages, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` pages, or return None and change nothing if fewer are free."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        top = self._top - n
        if top < 0:
            return None
        ids = self._stack_np[top : self._top].copy()
        self._in_use_np[ids] = True
        self._top = top
        return torch.from_numpy(ids)

    def free(self, pages: torch.Tensor) -> None:
        """Give pages back; raises (changing nothing) on a foreign id or a double free."""
        n = pages.numel()
        if n == 0:
            return
        if n == 1:
            page = int(pages)
            if not 0 < page < self.num_pages:
                raise ForeignPage(f"page id out of range 1..{self.num_pages - 1}: {page}")
            if not self._in_use_np[page]:
                raise DoubleFree(f"freeing pages not in use: [{page}]")
            self._in_use_np[page] = False
            self._stack_np[self._top] = page
            self._top += 1
            return
        if not pages.is_cpu or pages.dtype is not torch.int64 or pages.dim() != 1:
            pages = pages.detach().reshape(-1).to(dtype=torch.int64, device="cpu")
        ids = pages.numpy()
        if n > self.capacity - self._top or np.count_nonzero(self._held_np.take(ids, mode="clip")) != n:
            self._raise_for(ids)
        iota = self._iota[:n]
        self._stamp[ids] = iota  # a repeated id keeps only its last position
        if np.count_nonzero(self._stamp[ids] != iota):
            raise DoubleFree(f"page ids repeated within one free: {ids.tolist()}")
        self._in_use_np[ids] = False
        self._stack_np[self._top : self._top + n] = ids
        self._top += n

    def in_use(self, page: int) -> bool:
        """Whether `page` is held by a caller (the reserved page 0 always is)."""
        return page == 0 or bool(self._in_use_np[page])

    def _raise_for(self, ids: np.ndarray) -> None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 1 or hi >= self.num_pages:
            raise ForeignPage(f"page id out of range 1..{self.num_pages - 1}: {lo if lo < 1 else hi}")
        not_held = ids[~self._in_use_np[ids]]
        if not_held.size:
            raise DoubleFree(f"freeing pages not in use: {not_held.tolist()}")
        raise DoubleFree(f"page ids repeated within one free: {ids.tolist()}")

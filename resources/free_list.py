"""A free list of small integer ids (request slots, HiSparse slot maps).

Hands out the lowest free id first on a fresh list, and refuses a foreign
id or a double free with `ValueError`, changing nothing. Pages have their own
allocator (`resources.page_allocator`), built for batches of ids.
"""

from __future__ import annotations


class FreeList:
    def __init__(self, capacity: int, *, what: str = "id") -> None:
        self.capacity = capacity
        self.what = what
        self._free = list(range(capacity - 1, -1, -1))
        self._in_use = [False] * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """The lowest free id, or None when all are in use."""
        if not self._free:
            return None
        item = self._free.pop()
        self._in_use[item] = True
        return item

    def free(self, item: int) -> None:
        if not 0 <= item < self.capacity:
            raise ValueError(f"foreign {self.what} {item} (capacity {self.capacity})")
        if not self._in_use[item]:
            raise ValueError(f"{self.what} {item} freed twice")
        self._in_use[item] = False
        self._free.append(item)

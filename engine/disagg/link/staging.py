"""Staging memory of a link side: a bounded, leak-checked pool of byte buffers.

The prefill stages a job's KV here between its worker's send and the wire;
the decode receives each chunk into a buffer from here before writing it into
its pages. Buffers live in host memory (pinned on CUDA) for gloo, or on the
device for NCCL. `take` blocks (bounded) while the pool is full, so a slow
link pushes back on whoever fills it. Thread-safe: link threads take and
give; the memory report reads.

Buffers are allocated in size classes (four per doubling, so at most a
quarter of a buffer is slack) and lent as views of the size asked for; the
pool accounts what it allocated. Given-back buffers are kept for reuse (same
class, same device), up to `keep_bytes`, so a steady stream of jobs of
varying sizes does not pay for fresh allocations (first-touch page faults,
pinned registration) on every chunk, and resident memory stays bounded by
what is in use plus `keep_bytes`; kept buffers count as free, and are
dropped when a buffer of another class needs the room. A buffer a failed
receive was posted into is never reused (`reuse=False`).
"""

from __future__ import annotations

import threading
import time

import torch

from resources.ledger import Owner, PoolUsage
from resources.paging import size_class


class StagingFull(RuntimeError):
    """No staging memory freed up in time."""


class StagingPool:
    """`capacity` bytes; `held` by owner (a request id), for the memory report."""

    def __init__(self, name: str, capacity: int, device: torch.device, *, keep_bytes: int | None = None) -> None:
        self.name = name
        self.capacity = capacity
        self.device = device
        self.keep_bytes = capacity // 4 if keep_bytes is None else keep_bytes
        self._pin = device.type == "cuda"
        self._held: dict[str, int] = {}
        self._total = 0
        self._kept: dict[tuple[int, str], list[torch.Tensor]] = {}  # whole buffers by (class, device)
        self._kept_bytes = 0
        self._lent: dict[int, torch.Tensor] = {}  # a lent view's address -> its whole buffer
        self._cond = threading.Condition()

    def take(self, owner: str, nbytes: int, *, timeout: float, device: torch.device | None = None) -> torch.Tensor:
        """A uint8 buffer of `nbytes` (a view of its size class's buffer), accounted to `owner`;
        StagingFull after `timeout`."""
        if not 0 < nbytes <= self.capacity:
            raise StagingFull(f"{nbytes} bytes: a staging buffer is 1 to {self.capacity} bytes ({self.name})")
        target = device if device is not None else self.device
        size = size_class(nbytes, self.capacity)
        key = (size, str(target))
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._total + size > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if self._total + size > self.capacity:
                        raise StagingFull(f"{self.name}: {nbytes} bytes not free within {timeout:g} s")
            self._total += size
            self._held[owner] = self._held.get(owner, 0) + size
            kept = self._kept.get(key)
            if kept:
                self._kept_bytes -= size
                return self._lend(kept.pop(), nbytes)
            while self._kept_bytes and self._total + self._kept_bytes > self.capacity:
                self._drop_one()
        whole = torch.empty(size, dtype=torch.uint8, device=target, pin_memory=self._pin and target.type == "cpu")
        with self._cond:
            return self._lend(whole, nbytes)

    def give(self, owner: str, buf: torch.Tensor, *, reuse: bool = True) -> None:
        with self._cond:
            whole = self._lent.get(buf.data_ptr())
            if whole is None:
                raise RuntimeError(f"{self.name}: {owner} gives back a buffer this pool did not lend")
            size = whole.numel()
            have = self._held.get(owner, 0)
            if size > have:
                raise RuntimeError(f"{self.name}: {owner} gives back {size} bytes but holds {have}")
            del self._lent[buf.data_ptr()]
            if have == size:
                del self._held[owner]
            else:
                self._held[owner] = have - size
            self._total -= size
            if reuse and self._kept_bytes + size <= self.keep_bytes:
                self._kept.setdefault((size, str(whole.device)), []).append(whole)
                self._kept_bytes += size
            self._cond.notify_all()

    def _lend(self, whole: torch.Tensor, nbytes: int) -> torch.Tensor:
        view = whole[:nbytes]
        self._lent[view.data_ptr()] = whole
        return view

    def _drop_one(self) -> None:
        key = next(k for k, bufs in self._kept.items() if bufs)
        self._kept[key].pop()
        self._kept_bytes -= key[0]

    def stats(self) -> PoolUsage:
        """Bytes taken count as `shared`: held for requests outside the engine's ledger."""
        with self._cond:
            held = self._total
        return PoolUsage(capacity=self.capacity, free=self.capacity - held, shared=held, unit="bytes")

    @property
    def kept_bytes(self) -> int:
        """Bytes of given-back buffers kept for reuse (free, but resident)."""
        with self._cond:
            return self._kept_bytes

    @property
    def held(self) -> int:
        with self._cond:
            return self._total

    def shared_owners(self) -> list[Owner]:
        with self._cond:
            return [Owner(rid, None, None, n) for rid, n in sorted(self._held.items())]

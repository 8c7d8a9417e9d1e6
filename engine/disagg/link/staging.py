"""Staging memory of a link side: a bounded, leak-checked pool of byte buffers.

The prefill stages a job's KV here between its worker's send and the wire;
the decode receives each chunk into a buffer from here before writing it into
its pages. Buffers live in host memory (pinned on CUDA) for gloo, or on the
device for NCCL. `take` blocks (bounded) while the pool is full, so a slow
link pushes back on whoever fills it. Thread-safe: link threads take and
give; the memory report reads.

Given-back buffers are kept for reuse (same size, same device), so a steady
stream of jobs does not pay for fresh allocations (first-touch page faults,
pinned registration) on every chunk; kept buffers count as free, and are
dropped when a buffer of another size needs the room. A buffer a failed
receive was posted into is never reused (`reuse=False`).
"""

from __future__ import annotations

import threading
import time

import torch

from resources.ledger import Owner, PoolUsage


class StagingFull(RuntimeError):
    """No staging memory freed up in time."""


class StagingPool:
    """`capacity` bytes; `held` by owner (a request id), for the memory report."""

    def __init__(self, name: str, capacity: int, device: torch.device) -> None:
        self.name = name
        self.capacity = capacity
        self.device = device
        self._pin = device.type == "cuda"
        self._held: dict[str, int] = {}
        self._total = 0
        self._kept: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._kept_bytes = 0
        self._cond = threading.Condition()

    def take(self, owner: str, nbytes: int, *, timeout: float, device: torch.device | None = None) -> torch.Tensor:
        """A uint8 buffer of `nbytes`, accounted to `owner`; StagingFull after `timeout`."""
        if nbytes > self.capacity:
            raise StagingFull(f"{nbytes} bytes is more than the whole {self.name} pool ({self.capacity})")
        target = device if device is not None else self.device
        key = (nbytes, str(target))
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._total + nbytes > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if self._total + nbytes > self.capacity:
                        raise StagingFull(f"{self.name}: {nbytes} bytes not free within {timeout:g} s")
            self._total += nbytes
            self._held[owner] = self._held.get(owner, 0) + nbytes
            kept = self._kept.get(key)
            if kept:
                self._kept_bytes -= nbytes
                return kept.pop()
            while self._kept_bytes and self._total + self._kept_bytes > self.capacity:
                self._drop_one()
        return torch.empty(nbytes, dtype=torch.uint8, device=target, pin_memory=self._pin and target.type == "cpu")

    def give(self, owner: str, buf: torch.Tensor, *, reuse: bool = True) -> None:
        nbytes = buf.numel()
        with self._cond:
            have = self._held.get(owner, 0)
            if nbytes > have:
                raise RuntimeError(f"{self.name}: {owner} gives back {nbytes} bytes but holds {have}")
            if have == nbytes:
                del self._held[owner]
            else:
                self._held[owner] = have - nbytes
            self._total -= nbytes
            if reuse:
                self._kept.setdefault((nbytes, str(buf.device)), []).append(buf)
                self._kept_bytes += nbytes
            self._cond.notify_all()

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
    def held(self) -> int:
        with self._cond:
            return self._total

    def shared_owners(self) -> list[Owner]:
        with self._cond:
            return [Owner(rid, None, None, n) for rid, n in sorted(self._held.items())]

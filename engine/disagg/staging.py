"""Staging memory of a link side: a bounded, leak-checked pool of byte buffers.

The prefill stages a job's KV here between its worker's send and the wire;
the decode receives each chunk into a buffer from here before writing it into
its pages. Buffers live in host memory (pinned on CUDA) for gloo, or on the
device for NCCL. `take` blocks (bounded) while the pool is full, so a slow
link pushes back on whoever fills it. Thread-safe: link threads take and
give; the memory report reads.
"""

from __future__ import annotations

import threading
import time

import torch

from resources.ledger import Owner, PoolStats


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
        self._cond = threading.Condition()

    def take(self, owner: str, nbytes: int, *, timeout: float, device: torch.device | None = None) -> torch.Tensor:
        """A uint8 buffer of `nbytes`, accounted to `owner`; StagingFull after `timeout`."""
        if nbytes > self.capacity:
            raise StagingFull(f"{nbytes} bytes is more than the whole {self.name} pool ({self.capacity})")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._total + nbytes > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if self._total + nbytes > self.capacity:
                        raise StagingFull(f"{self.name}: {nbytes} bytes not free within {timeout:g} s")
            self._total += nbytes
            self._held[owner] = self._held.get(owner, 0) + nbytes
        target = device if device is not None else self.device
        pin = self._pin and target.type == "cpu"
        return torch.empty(nbytes, dtype=torch.uint8, device=target, pin_memory=pin)

    def give(self, owner: str, nbytes: int) -> None:
        with self._cond:
            have = self._held.get(owner, 0)
            if nbytes > have:
                raise RuntimeError(f"{self.name}: {owner} gives back {nbytes} bytes but holds {have}")
            if have == nbytes:
                del self._held[owner]
            else:
                self._held[owner] = have - nbytes
            self._total -= nbytes
            self._cond.notify_all()

    def held_by(self, owner: str) -> int:
        with self._cond:
            return self._held.get(owner, 0)

    def stats(self) -> PoolStats:
        with self._cond:
            held = self._total
        return PoolStats(capacity=self.capacity, free=self.capacity - held, evictable=0, held=held, unit="bytes")

    def owners(self) -> list[Owner]:
        with self._cond:
            return [Owner(rid, None, None, n) for rid, n in sorted(self._held.items())]

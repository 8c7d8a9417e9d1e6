"""Fenced copies between the device and the host pool.

On CUDA, device -> host copies run on a side stream that first waits for the
compute stream; an event recorded after them is the fence (`CopyFence.
for_cuda_event`). On CPU the same calls copy synchronously and the fence is
complete at once. Host -> device swap-ins run on the compute stream from a
pinned staging tensor, so the attention that reads them is ordered after.

Decode backups (each step's new K/V of every row, per layer) are one copy
per layer into a pinned staging buffer, not one per row: the rows' host
locations are scattered, so the copy lands in staging and is scattered into
the host pool on the host once its event is done (`apply_backups`), which
runs before anything reads or frees host rows: at the next sparse step and
in `drain` (the host hook drains before freeing pages)::

    step t, layer l:  new K/V [B, 2, H, D] --D2H (side stream)--> staging[l]
    fence:            event after the last layer's copy (CopyFence polls it)
    step t+1 / drain: event.synchronize(), host.kv[l][rows] = staging[l]

`BACKUP_FENCE` ("host_backup") names every fence made here; naming it in
`FaultInjector.stuck_fences` makes those fences never complete, so a test can
hold a request in STAGING and watch its abort quarantine at the deadline. An
injector with a `stuck_fence_when(fence_name, request_id)` predicate does the
same for the requests it returns True for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from resources.device_io import compute_stream, copy_to_host, pinned_empty, to_host
from resources.fences import CopyFence

BACKUP_FENCE = "host_backup"


class HostCopier:
    """Device <-> host copies for one engine, and the fences that guard them.

    `deferred` (default: on CUDA) stages decode backups and scatters them once
    their event is done; `events` makes the events (default `torch.cuda.Event`;
    tests pass fakes to check the order on CPU).
    """

    def __init__(self, device: torch.device, *, fence_timeout: float, faults: Any = None,
                 deferred: bool | None = None, events: Callable[[], Any] | None = None) -> None:
        self.device = device
        self.fence_timeout = fence_timeout
        self.faults = faults
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.deferred = self.cuda if deferred is None else deferred
        self._events = events if events is not None else (torch.cuda.Event if self.cuda else None)
        #: backups copied into staging but not yet into the host pool: (dst, rows, staged)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        #: the event after the pending backups' copies (None: not recorded yet)
        self._pending_done: Any = None
        self._staging: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run device -> host copies (and their producers) after the compute stream's work so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(compute_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def to_host(self, dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
        """dst[rows[i]] = src[i]; `dst` and `rows` on the host, `src` on device.

        Call inside `side()`. On CUDA each run of consecutive rows is one
        asynchronous copy into the pinned `dst` (host pages are handed out in
        runs, so a prompt is a few copies).
        """
        if not self.cuda:
            dst.index_copy_(0, rows, to_host(src))
            return
        if self.stream is not None:
            src.record_stream(self.stream)  # `src` may come from the compute stream's allocations
        ids = rows.numpy()
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        for start, end in zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [len(ids)]))):
            first = int(ids[start])
            copy_to_host(dst[first : first + (end - start)], src[start:end])

    def backup(self, layer: int, dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
        """dst[rows[i]] = src[i] for one layer's decode rows: one copy (call inside `side()`)."""
        if not self.deferred:
            dst.index_copy_(0, rows, to_host(src))
            return
        staged = self._staged(layer, src)
        if self.stream is not None:
            src.record_stream(self.stream)
        copy_to_host(staged, src)
        self._pending.append((dst, rows, staged))
        self._pending_done = None  # a copy after the last recorded event

    def _staged(self, layer: int, src: torch.Tensor) -> torch.Tensor:
        buf = self._staging.get(layer)
        if buf is None or buf.shape[0] < src.shape[0] or buf.shape[1:] != src.shape[1:] or buf.dtype != src.dtype:
            rows = max(src.shape[0], 0 if buf is None else buf.shape[0])
            buf = self._staging[layer] = pinned_empty((rows, *src.shape[1:]), src.dtype, pin=self.cuda)
        return buf[: src.shape[0]]

    def apply_backups(self) -> None:
        """Scatter the staged backups into the host pool, once their copies are done."""
        if not self._pending:
            return
        if self._pending_done is not None:
            if not self._pending_done.query():  # usually done: the step's read-back waited for its stream
                self._pending_done.synchronize()
        elif self.stream is not None:  # a step that failed before its fence: wait for what it queued
            self.stream.synchronize()
        for dst, rows, staged in self._pending:
            dst.index_copy_(0, rows, staged)
        self._pending.clear()
        self._pending_done = None

    def from_host(self, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """src[rows] on the device; `src` and `rows` on the host. Compute stream, one copy."""
        if not self.cuda:
            return src.index_select(0, rows).to(self.device)
        staged = torch.empty((rows.shape[0], *src.shape[1:]), dtype=src.dtype, pin_memory=True)
        torch.index_select(src, 0, rows, out=staged)
        return staged.to(self.device, non_blocking=True)

    def fence(self, protects: Iterable[str], request_id: str) -> CopyFence:
        """A fence for the side-stream copies issued so far (for `request_id`)."""
        if self._stuck(request_id):
            return self.faults.stuck_fence(BACKUP_FENCE, protects, timeout=self.fence_timeout)
        event = self.event()
        if event is None:
            return CopyFence.completed(BACKUP_FENCE, protects)
        return CopyFence.for_cuda_event(BACKUP_FENCE, protects, event, timeout=self.fence_timeout)

    def drain(self) -> None:
        """Wait for every side-stream copy issued so far, and land the staged backups.

        NOTE: fences cover every copy of a step that completes; a step that
        fails between layers leaves its first layers' backups unfenced, so
        the host hook drains before freeing host pages.
        """
        if self.stream is not None:
            self.stream.synchronize()
        self.apply_backups()

    def _stuck(self, request_id: str) -> bool:
        return self.faults is not None and self.faults.fence_stuck(BACKUP_FENCE, request_id)

    def event(self) -> Any:
        """An event after the side stream's work so far (None without events), for host readers;
        it also marks the staged backups issued so far as done once it is."""
        if self._events is None:
            return None
        event = self._events()
        if self.stream is not None:
            event.record(self.stream)
        else:
            event.record()
        if self._pending:
            self._pending_done = event
        return event

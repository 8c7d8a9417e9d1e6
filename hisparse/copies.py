"""Fenced copies between the device and the host pool.

On CUDA, device -> host copies run on a side stream that first waits for the
compute stream; an event recorded after them is the fence (`CopyFence.
for_cuda_event`). On CPU the same calls copy synchronously and the fence is
complete at once. Host -> device swap-ins run on the compute stream from a
pinned staging tensor, so the attention that reads them is ordered after.

`BACKUP_FENCE` ("host_backup") names every fence made here; naming it in
`FaultInjector.stuck_fences` makes those fences never complete, so a test can
hold a request in STAGING and watch its abort quarantine at the deadline. An
injector with a `stuck_fence_when(fence_name, request_id)` predicate does the
same for the requests it returns True for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from resources.fences import CopyFence

BACKUP_FENCE = "host_backup"


class HostCopier:
    """Device <-> host copies for one engine, and the fences that guard them."""

    def __init__(self, device: torch.device, *, fence_timeout: float, faults: Any = None) -> None:
        self.device = device
        self.fence_timeout = fence_timeout
        self.faults = faults
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run device -> host copies (and their producers) after the compute stream's work so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def to_host(self, dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
        """dst[rows[i]] = src[i]; `dst` and `rows` on the host, `src` on device.

        Call inside `side()`. On CUDA each run of consecutive rows is one
        asynchronous copy into the pinned `dst` (host pages are handed out in
        runs, so a prompt is a few copies, a decode token one).
        """
        if not self.cuda:
            dst.index_copy_(0, rows, src)
            return
        if self.stream is not None:
            src.record_stream(self.stream)  # `src` may come from the compute stream's allocations
        ids = rows.numpy()
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        for start, end in zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [len(ids)]))):
            first = int(ids[start])
            dst[first : first + (end - start)].copy_(src[start:end], non_blocking=True)

    def from_host(self, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """src[rows] on the device; `src` and `rows` on the host. Compute stream."""
        if not self.cuda:
            return src.index_select(0, rows)
        staged = torch.empty((rows.shape[0], *src.shape[1:]), dtype=src.dtype, pin_memory=True)
        torch.index_select(src, 0, rows, out=staged)
        return staged.to(self.device, non_blocking=True)

    def fence(self, protects: Iterable[str], request_id: str) -> CopyFence:
        """A fence for the side-stream copies issued so far (for `request_id`)."""
        if self._stuck(request_id):
            return self.faults.stuck_fence(BACKUP_FENCE, protects, timeout=self.fence_timeout)
        if self.stream is None:
            return CopyFence.completed(BACKUP_FENCE, protects)
        event = torch.cuda.Event()
        event.record(self.stream)
        return CopyFence.for_cuda_event(BACKUP_FENCE, protects, event, timeout=self.fence_timeout)

    def drain(self) -> None:
        """Wait for every side-stream copy issued so far (no-op on CPU).

        NOTE: fences cover every copy of a step that completes; a step that
        fails between layers leaves its first layers' backups unfenced, so
        the host hook drains before freeing host pages.
        """
        if self.stream is not None:
            self.stream.synchronize()

    def _stuck(self, request_id: str) -> bool:
        return self.faults is not None and self.faults.fence_stuck(BACKUP_FENCE, request_id)

    def event(self) -> Any:
        """An event after the side stream's work so far (None on CPU), for host readers."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

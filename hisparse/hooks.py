"""HiSparse's resource hooks: host pages, device buffer slots, slot maps.

They follow `resources.contract` and are released in this order, all before
the KV hook (as SGLang's ``request_finished`` runs before
``release_kv_cache``)::

    hook              acquire_on                 scope
    hisparse_device   DECODING                   DECODING, FINISHED
    hisparse_host     PREFILLING, TRANSFERRING   TRANSFERRING .. DECODING, FINISHED
    hisparse_map      DECODING                   DECODING, FINISHED
    hisparse_staging  STAGING                    STAGING (holds nothing: acquiring it stages)

RETRACTED is in no scope, so preemption releases all three; QUEUED neither,
so a re-queued request holds nothing here. Host pages are taken at admission
(PREFILLING, or TRANSFERRING in the decode role where a transfer can land
straight in them), so a short host pool delays admission instead of failing
a transition the loop cannot retry. Acquisition runs in reverse release
order, so on entering DECODING the map exists when the device buffer is
filled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hisparse import lru
from hisparse.pools import DEVICE_SLOTS, HOST_PAGES, SLOT_MAPS
from hisparse.records import (DEVICE_HOOK, HOST_HOOK, MAP_HOOK, STAGING_HOOK, DeviceBuffer, HostRecord, SlotMap,
                              host_record)
from resources.contract import ResourceExhausted, ResourceHook
from resources.device_io import upload
from resources.request_slots import RequestSlotHook
from states import Handle, Request, RequestState

if TYPE_CHECKING:
    from hisparse.state import HiSparseState

S = RequestState
__all__ = ["DEVICE_HOOK", "HOST_HOOK", "MAP_HOOK", "STAGING_HOOK", "DeviceBuffer", "DeviceBufferHook", "HostPagesHook",
           "HostRecord", "SlotMap", "SlotMapHook", "StagingHook"]


class _HiSparseHook(ResourceHook):
    before = ("kv",)

    def __init__(self, state: HiSparseState) -> None:
        self.state = state


class HostPagesHook(_HiSparseHook):
    """Host pages for every token of the request (taken at admission, grown per token)."""

    name = HOST_HOOK
    pool = HOST_PAGES
    acquire_on = frozenset({S.PREFILLING, S.TRANSFERRING})
    scope = frozenset({S.TRANSFERRING, S.PREFILLING, S.PREBUILT, S.STAGING, S.DECODING, S.FINISHED})

    def acquire(self, request: Request, into: RequestState) -> Handle:
        host = self.state.host
        need = host.pages_for(request.num_tokens)
        pages = host.allocator.alloc(need)
        if pages is None:
            raise ResourceExhausted(f"need {need} HiSparse host pages, {host.allocator.num_free} free")
        locs = torch.zeros(self.state.max_context + host.page_size, dtype=torch.int64)
        locs_dev = locs if self.state.device.type == "cpu" else torch.zeros_like(locs, device=self.state.device)
        pages_dev = torch.zeros(host.pages_for(self.state.max_context), dtype=torch.int64, device=self.state.device)
        record = HostRecord([], locs, locs.numpy(), locs_dev, pages_dev)
        self._extend(record, pages)
        return Handle(self.name, request.request_id, record, amount=need)

    record = staticmethod(host_record)

    def grow(self, request: Request, handle: Handle, num_tokens: int) -> bool:
        """Cover `num_tokens` tokens; False (changing nothing) if the pool is short."""
        record: HostRecord = handle.payload
        host = self.state.host
        need = host.pages_for(num_tokens) - len(record.pages)
        if need <= 0:
            return True
        pages = host.allocator.alloc(need)
        if pages is None:
            return False
        self._extend(record, pages)
        handle.amount = len(record.pages)
        return True

    def _extend(self, record: HostRecord, pages: torch.Tensor) -> None:
        host = self.state.host
        # NOTE: ascending, so consecutive pages are consecutive host rows: a staging copy
        # is one copy per run, and scoring reads each run's index keys in place
        pages = torch.sort(pages).values
        for page in pages.tolist():
            if record.runs and record.runs[-1][0] + record.runs[-1][1] == page:
                record.runs[-1][1] += 1
            else:
                record.runs.append([page, 1])
        start = len(record.pages) * host.page_size
        locs = host.locations(pages)
        record.locs[start : start + locs.numel()] = locs
        # NOTE: one asynchronous copy from pinned memory (`upload`): no wait on the event loop's thread
        first, dev = len(record.pages), self.state.device
        sent = upload(np.concatenate((pages.numpy(), locs.numpy())), dev)
        record.pages_dev[first : first + pages.numel()].copy_(sent[: pages.numel()])
        if record.locs_dev is not record.locs:
            record.locs_dev[start : start + locs.numel()].copy_(sent[pages.numel() :])
        record.pages.extend(pages.tolist())

    def release(self, request: Request, handle: Handle) -> None:
        record: HostRecord = handle.payload
        self.state.copier.drain()
        self.state.host.allocator.free(torch.tensor(record.pages, dtype=torch.int64))


class DeviceBufferHook(_HiSparseHook):
    """A bounded device buffer per decoding request, filled at once for short contexts."""

    name = DEVICE_HOOK
    pool = DEVICE_SLOTS
    acquire_on = frozenset({S.DECODING})
    scope = frozenset({S.DECODING, S.FINISHED})

    def buffer_size(self, request: Request) -> int:
        """N: device_buffer_size, or fewer when the request can never use them all."""
        most = request.num_prompt_tokens + request.params.max_new_tokens - 1
        return max(1, min(self.state.config.device_buffer_size, most))

    def acquire(self, request: Request, into: RequestState) -> Handle:
        state = self.state
        size = self.buffer_size(request)
        ids = state.device_pool.allocator.alloc(size + 1)
        if ids is None:
            raise ResourceExhausted(
                f"need {size + 1} HiSparse device slots, {state.device_pool.allocator.num_free} free"
            )
        dev = state.device
        layers = state.num_layers
        buffer = DeviceBuffer(
            slots=upload(ids.numpy(), dev),
            slots_np=ids.numpy(),
            slot_token=np.full((layers, size), -1, dtype=np.int64),
            last_used=np.full((layers, size), -1, dtype=np.int64),
        )
        n = request.kv_len
        record: HostRecord = request.handles[HOST_HOOK].payload
        if 0 < n <= size and (record.landed_directly or RequestSlotHook.name in request.handles):
            # NOTE: the KV pages are still held: this transition acquires before it releases.
            self._preload(request, buffer, record, n)
        return Handle(self.name, request.request_id, buffer, amount=size + 1)

    def _preload(self, request: Request, buffer: DeviceBuffer, record: HostRecord, n: int) -> None:
        """Copy the context's K/V into slots 0..n-1 of every layer: from the device KV pages,
        or from the host rows when a transfer landed there directly."""
        state = self.state
        dst = buffer.slots[:n]
        src = None if record.landed_directly else state.kv_pool.slots.req_to_token[RequestSlotHook.slot(request), :n]
        for layer in range(state.num_layers):
            if src is None:
                kv = state.copier.from_host(state.host.kv[layer], record.locs[:n])
            else:
                kv = torch.stack((state.kv_buffers.k[layer].index_select(0, src),
                                  state.kv_buffers.v[layer].index_select(0, src)), dim=1)
            state.device_pool.kv[layer].index_copy_(0, dst, kv.to(state.device_pool.kv[layer].dtype))
        slot_map: SlotMap = request.handles[MAP_HOOK].payload
        lru.preload(slot_map.table, buffer.slot_token, buffer.last_used, n)

    def release(self, request: Request, handle: Handle) -> None:
        buffer: DeviceBuffer = handle.payload
        self.state.device_pool.allocator.free(torch.from_numpy(buffer.slots_np))


class SlotMapHook(_HiSparseHook):
    """The token -> device-slot map of a decoding request, one per layer."""

    name = MAP_HOOK
    pool = SLOT_MAPS
    acquire_on = frozenset({S.DECODING})
    scope = frozenset({S.DECODING, S.FINISHED})

    def acquire(self, request: Request, into: RequestState) -> Handle:
        maps = self.state.maps
        row = maps.alloc()
        if row is None:
            raise ResourceExhausted(f"all {maps.capacity} HiSparse slot maps are in use")
        table = maps.table[row]
        table.fill(-1)
        return Handle(self.name, request.request_id, SlotMap(row, table), amount=1)

    def release(self, request: Request, handle: Handle) -> None:
        self.state.maps.free(handle.payload.row)


class StagingHook(_HiSparseHook):
    """Entering STAGING starts the fenced copy of the context's KV to host.

    It holds no memory (the host pages are the host hook's): its acquisition is
    the staging step, so a staging copy that cannot start is a refused move
    like any other, and a failure finishes the request with ERROR.
    """

    name = STAGING_HOOK
    acquire_on = frozenset({S.STAGING})
    scope = frozenset({S.STAGING})

    def acquire(self, request: Request, into: RequestState) -> Handle[None]:
        fence = self.state.stage(request)
        return Handle(self.name, request.request_id, fences=(fence,))

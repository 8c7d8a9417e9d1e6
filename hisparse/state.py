"""HiSparseState: one engine's HiSparse pools, copier and index projection,
and the staging copy the staging hook runs.

Lifecycle of a HiSparse request (hooks in `hisparse.hooks`)::

    PREFILLING   host pages and device KV pages taken for the prompt (admission)
    TRANSFERRING (decode role) host pages only: the transfer lands the prompt's
                 K/V straight in the host rows, and no device KV page is taken
    PREBUILT     prompt KV complete (in device KV pages, or already on host)
    STAGING      the staging hook's acquisition runs `stage`: the prompt KV not
                 on host yet -> host, index keys computed; its fence comes back
                 with the staging handle and the machine adds it
    DECODING     (fences done) device buffer + slot map taken, short contexts
                 preloaded (from the KV pages, or the host rows), then the KV
                 pages, if any, are released
    each step    the machine grows the host pages; sparse attention backs up
                 the new token, and the step's output carries the backup's fence
    FINISHED     fences awaited (or quarantined at their deadline), then all
                 handles released, HiSparse before KV
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from hisparse.config import HiSparseConfig
from hisparse.copies import HostCopier
from hisparse.records import DEVICE_HOOK, HOST_HOOK, DeviceBuffer, HostRecord, host_record
from hisparse.pools import DeviceBufferPool, HostKVPool, SlotMapPool
from hisparse.selection import IndexProjection
from resources.kv_buffers import KVBuffers
from resources.kv_pool import KVPool
from resources.request_slots import RequestSlotHook
from states import Fence, Request, RequestState

log = structlog.get_logger("kvlife.hisparse")


class HiSparseState:
    """Shared by the hooks, the sparse attention and the loop's callbacks."""

    def __init__(self, *, config: HiSparseConfig, engine_config: Any, model_config: Any, device: torch.device,
                 max_context: int, kv_pool: KVPool, kv_buffers: KVBuffers, faults: Any = None) -> None:
        self.config = config
        self.device = device
        self.kv_pool = kv_pool
        self.kv_buffers = kv_buffers
        self.num_layers = model_config.num_layers
        self.max_context = max_context
        dtype = kv_buffers.k[0].dtype
        kv_heads, head_dim = model_config.num_kv_heads, model_config.head_dim
        self.projection = IndexProjection(num_heads=model_config.num_heads, num_kv_heads=kv_heads,
                                          head_dim=head_dim, index_dim=config.index_dim, device=device,
                                          dtype=dtype, seed=engine_config.seed)
        self.host = HostKVPool(num_tokens=config.host_tokens(engine_config), page_size=engine_config.page_size,
                               num_layers=self.num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                               index_dim=self.projection.dim, dtype=dtype, device=device)
        max_running = engine_config.max_running
        self.device_pool = DeviceBufferPool(num_slots=max_running * (config.device_buffer_size + 1),
                                            num_layers=self.num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                                            dtype=dtype, device=device)
        self.maps = SlotMapPool(num_maps=max_running, num_layers=self.num_layers,
                                max_context=max_context)
        self.copier = HostCopier(device, fence_timeout=engine_config.fence_timeout, faults=faults)
        #: a staging copy reads KV pages and writes host pages
        self.staging_protects = frozenset({"kv", HOST_HOOK})
        #: a decode backup writes host pages (from the step's own K/V tensor)
        self.backup_protects = frozenset({HOST_HOOK})
        #: tokens copied host -> device by swap-ins (for benchmarks)
        self.swapped_in = 0
        #: when a list, sparse attention appends one record per request and layer (tests)
        self.trace: list[dict[str, Any]] | None = None
        #: select every row's top-k at once (always off the host; tests force it on the host)
        self.batched_selection = False

    @property
    def pools(self) -> list[Any]:
        return [self.device_pool, self.host, self.maps]

    def is_sparse(self, request: Request) -> bool:
        """Whether this request's decode rows go to sparse attention."""
        return request.state is RequestState.DECODING and DEVICE_HOOK in request.handles

    # ------------------------------------------------------------- staging
    def stage(self, request: Request) -> Fence:
        """Copy the context's KV from device pages to host, compute index keys; returns the
        copy's fence (the staging hook hands it to the machine with its handle).

        Copies only tokens not on the host yet (a decode-role transfer that
        landed in the host pages sets `HostRecord.on_host` and is not copied).
        """
        record: HostRecord = host_record(request)
        start, end = record.on_host, request.kv_len
        if end > start:
            src = self.kv_pool.slots.req_to_token[RequestSlotHook.slot(request), start:end]
            rows, rows_dev = record.locs[start:end], record.locs_dev[start:end]
            with self.copier.side():
                for layer in range(self.num_layers):
                    k = self.kv_buffers.k[layer].index_select(0, src)
                    kv = torch.stack((k, self.kv_buffers.v[layer].index_select(0, src)), dim=1)
                    index = self.host.index[layer]
                    index.index_copy_(0, rows_dev, self.projection.keys(k).to(index.dtype))
                    self.copier.to_host(self.host.kv[layer], rows, kv.to(self.host.kv[layer].dtype))
            record.on_host = end
        log.debug("hisparse.staged", request_id=request.request_id, tokens=end - start)
        return self.copier.fence(self.staging_protects, request.request_id)

    # ------------------------------------------------------------ reporting
    def device_bytes(self, request: Request) -> dict[str, int]:
        """Device bytes the request holds: KV buffer slots, and index keys + slot map."""
        buffer: DeviceBuffer | None = getattr(request.handles.get(DEVICE_HOOK), "payload", None)
        record: HostRecord | None = getattr(request.handles.get(HOST_HOOK), "payload", None)
        slots = 0 if buffer is None else buffer.slots.shape[0]
        tokens = 0 if record is None else len(record.pages) * self.host.page_size
        return {
            "kv_buffer": slots * self.device_pool.bytes_per_slot,
            "index_keys": tokens * self.host.index_bytes_per_token,
            "slot_map": self.maps.bytes_per_map if buffer is not None else 0,
        }

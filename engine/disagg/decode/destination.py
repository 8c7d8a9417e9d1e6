"""Where a received job's KV lands on the decode side.

A destination is written only by the link's receiving thread, one chunk at
a time, always under the job's lock (`engine.disagg.decode.decode_link`), so once
the job is done (landed, failed or given up) nothing writes it again.

- `PagedDestination`: the request's KV pages (`KVBuffers`, at the token
  locations the KV hook pre-allocated).
- `HostRowsDestination`: HiSparse's host pool rows (and the index keys
  computed from K), so the KV never detours through device pages.

On CUDA with a host-memory backend (gloo), a chunk arrives in pinned host
memory: the copy to the device runs on a side stream and is waited for
before `write` returns, so the write is complete when the lock is released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.disagg.link.wire import Chunk


class KVDestination(Protocol):
    #: tokens the job carries
    num_tokens: int
    #: device the KV finally lives on (a chunk is moved there before it is written)
    device: torch.device
    #: the hooks whose memory `write` writes besides the KV pages' (the transfer's fence guards them)
    protects: tuple[str, ...]

    def write(self, chunk: Chunk, kv: torch.Tensor) -> None:
        """Write `kv` [layers, 2, tokens, heads, dim] (on any device) for `chunk`; return when written."""

    def landed(self) -> None:
        """The whole job has landed (called once, on the event loop, when the transfer's handle goes)."""


class _SideStream:
    """Copies a chunk to the destination's device on a side stream (CUDA), waited for before return."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, kv: torch.Tensor, device: torch.device, write: Callable[[torch.Tensor], None]) -> None:
        if self.stream is None or kv.device == device:
            write(kv.to(device))
            return
        with torch.cuda.stream(self.stream):
            write(kv.to(device, non_blocking=True))
        self.stream.synchronize()


class PagedDestination:
    """The request's KV pages: `locs[i]` is token i's location in every layer's K/V buffer."""

    protects: tuple[str, ...] = ()

    def __init__(self, kv_buffers: Any, locs: torch.Tensor) -> None:
        self.kv = kv_buffers
        self.device = kv_buffers.k[0].device
        self.locs = locs.to(self.device)
        self.num_tokens = int(locs.numel())
        self._copy = _SideStream(self.device)

    def write(self, chunk: Chunk, kv: torch.Tensor) -> None:
        locs = self.locs[chunk.start: chunk.start + chunk.count]

        def scatter(kv_dev: torch.Tensor) -> None:
            for i in range(chunk.num_layers):
                layer = chunk.first_layer + i
                self.kv.k[layer].index_copy_(0, locs, kv_dev[i, 0])
                self.kv.v[layer].index_copy_(0, locs, kv_dev[i, 1])

        self._copy.run(kv, self.device, scatter)

    def landed(self) -> None:
        """Nothing to do: the pages are the request's KV, counted by its `kv_len`."""

    def copy_from(self, src: Any, src_locs: torch.Tensor) -> None:
        """Copy the K/V at `src_locs` of every layer of `src` (another engine's `KVBuffers` on
        this device: the in-process prefill) straight into the pages."""
        locs = self.locs
        for layer in range(len(self.kv.k)):
            self.kv.k[layer].index_copy_(0, locs, src.k[layer][src_locs].to(self.kv.k[layer].dtype))
            self.kv.v[layer].index_copy_(0, locs, src.v[layer][src_locs].to(self.kv.v[layer].dtype))


class HostRowsDestination:
    """HiSparse host rows `rows[i]` of token i: `host.kv[layer][row] = (K, V)`; index keys from K.

    `keys(k)` computes a layer's index keys from K [tokens, heads, dim] on
    the index device (HiSparse's `IndexProjection.keys`).
    """

    def __init__(self, host_pool: Any, rows: torch.Tensor, keys: Callable[[torch.Tensor], torch.Tensor],
                 index_device: torch.device, record: Any = None) -> None:
        self.record = record  # the host hook's record, told when the whole job has landed
        self.host = host_pool
        self.rows = rows.to("cpu")
        self.rows_dev = rows.to(index_device)
        self.keys = keys
        self.device = index_device
        self.num_tokens = int(rows.numel())
        #: the hooks whose memory this destination writes (so the transfer's fence guards them)
        self.protects: tuple[str, ...] = ("hisparse_host",)

    def write(self, chunk: Chunk, kv: torch.Tensor) -> None:
        rows = self.rows[chunk.start: chunk.start + chunk.count]
        rows_dev = self.rows_dev[chunk.start: chunk.start + chunk.count]
        for i in range(chunk.num_layers):
            layer = chunk.first_layer + i
            host = self.host.kv[layer]
            host.index_copy_(0, rows, kv[i].transpose(0, 1).to("cpu", host.dtype))
            index = self.host.index[layer]
            index.index_copy_(0, rows_dev, self.keys(kv[i, 0].to(self.device)).to(index.dtype))

    def landed(self) -> None:
        """The whole job is in the host rows: staging has nothing left to copy."""
        if self.record is not None:
            self.record.on_host = self.num_tokens
            self.record.landed_directly = True


class HostLanding:
    """Where a HiSparse decode-role transfer lands: the request's host rows (held already: the
    host hook acquires on TRANSFERRING before the transfer hook), never device KV pages."""

    protects: tuple[str, ...] = ("hisparse_host",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def destination(self, request: Any, num_tokens: int) -> HostRowsDestination:
        from hisparse.hooks import HostPagesHook

        state, record = self.state, HostPagesHook.record(request)
        return HostRowsDestination(state.host, record.locs[:num_tokens], state.projection.keys, state.device, record)

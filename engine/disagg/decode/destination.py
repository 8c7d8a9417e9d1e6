"""Where a received job's KV lands on the decode side.

A destination is written only by the link's receiving thread, one chunk at
a time, always under the job's lock (`engine.disagg.decode.decode_link`), so once
the job is done (landed, failed or given up) nothing writes it again.

- `PagedDestination`: the request's KV pages (`KVBuffers`, at the token
  locations the KV hook pre-allocated). It also hands out views of its
  pages (`views`), so a link whose data group reaches them receives each
  message straight into them (`engine.disagg.link.messages`).
- `HostRowsDestination`: HiSparse's host pool rows (and the index keys
  computed from K), so the KV never detours through device pages.

On CUDA every write runs on the destination's side stream (created on the
destination's device), which first waits for the compute stream (nothing
queued there may still use the pages), and `write` returns only once an
event recorded after the write is done: a chunk that arrived in pinned host
memory (gloo) or in device memory (NCCL) alike is written when the lock is
released, so the job's fence completes after its copies, never while one is
only queued. The link's receiving thread has already waited for the chunk
itself (`Pair.wait`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from engine.disagg.link.messages import Piece, direct_views, run_starts
from engine.disagg.link.wire import Chunk
from hisparse.records import host_record
from resources.device_io import compute_stream, on_device, to_host


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


class SideStream:
    """Runs a chunk's write on a side stream of the destination's device (CUDA): after the
    compute stream's work so far, and returns once an event after the write is done.

    `stream`, `events`, `enter` and `after` (tests) replace the CUDA stream, the event type,
    entering the stream and the compute stream's wait, so the order can be checked on the host.
    """

    def __init__(self, device: torch.device, *, stream: Any = None, events: Any = None,
                 enter: Callable[[Any], AbstractContextManager[Any]] | None = None,
                 after: Callable[[], Any] | None = None) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.stream = stream if stream is not None else (torch.cuda.Stream(device) if cuda else None)
        self._events: Any = events if events is not None else (torch.cuda.Event if cuda else None)
        self._enter = enter if enter is not None else torch.cuda.stream
        self._after = after if after is not None else (lambda: compute_stream(device))

    def run(self, kv: torch.Tensor, device: torch.device, write: Callable[[torch.Tensor], None]) -> None:
        if self.stream is None:
            write(kv.to(device))
            return
        self.stream.wait_stream(self._after())  # NOTE: before writing: pages the compute stream still uses
        with on_device(self.device), self._enter(self.stream):
            write(kv.to(device, non_blocking=True))
        done = self._events()
        done.record(self.stream)
        done.synchronize()  # NOTE: the write is complete before the job (and its fence) can end


class PagedDestination:
    """The request's KV pages: `locs[i]` is token i's location in every layer's K/V buffer.

    `host_locs` are the same locations in host memory (from the request's page ids, so a device
    destination needs no read-back); without them they are read from `locs`."""

    protects: tuple[str, ...] = ()

    def __init__(self, kv_buffers: Any, locs: torch.Tensor, host_locs: npt.NDArray[np.int64] | None = None) -> None:
        self.kv = kv_buffers
        self.device = kv_buffers.k[0].device
        self.locs = locs.to(self.device)
        self.host_locs = host_locs if host_locs is not None else locs.cpu().numpy()
        self.num_tokens = int(locs.numel())
        self._copy = SideStream(self.device)

    def run_starts(self) -> list[int]:
        """Where its runs of consecutive locations start (after the first)."""
        return run_starts(self.host_locs)

    def views(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """Each message's view of the pages (a message never crosses one of `run_starts`)."""
        return direct_views(self.kv.k, self.kv.v, self.host_locs, pieces)

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
        this device: the in-process prefill) straight into the pages, on the side stream as a
        chunk's write is, and complete when this returns."""

        def write(locs: torch.Tensor) -> None:
            for layer in range(len(self.kv.k)):
                self.kv.k[layer].index_copy_(0, locs, src.k[layer][src_locs].to(self.kv.k[layer].dtype))
                self.kv.v[layer].index_copy_(0, locs, src.v[layer][src_locs].to(self.kv.v[layer].dtype))

        self._copy.run(self.locs, self.device, write)


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
        self._copy = SideStream(index_device)

    def write(self, chunk: Chunk, kv: torch.Tensor) -> None:
        rows = self.rows[chunk.start: chunk.start + chunk.count]
        rows_dev = self.rows_dev[chunk.start: chunk.start + chunk.count]
        for i in range(chunk.num_layers):
            host = self.host.kv[chunk.first_layer + i]
            host.index_copy_(0, rows, to_host(kv[i].transpose(0, 1)).to(host.dtype))

        def index_keys(keys_dev: torch.Tensor) -> None:
            for i in range(chunk.num_layers):
                index = self.host.index[chunk.first_layer + i]
                index.index_copy_(0, rows_dev, self.keys(keys_dev[i]).to(index.dtype))

        self._copy.run(kv[:, 0], self.device, index_keys)

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
        state, record = self.state, host_record(request)
        return HostRowsDestination(state.host, record.locs[:num_tokens], state.projection.keys, state.device, record)

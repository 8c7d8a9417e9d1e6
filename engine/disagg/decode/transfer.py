"""KV transfer backends: how a prefill's K/V reaches the decode side's pages.

`TransferBackend.send` copies the K/V of every layer at some source
locations to destination locations on the receiving side and returns when
the copy has landed (or raises `TransferFailed`). `LoopbackTransfer` is the
in-process backend: a real copy between two engines' KV buffers, on a side
stream on CUDA.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.disagg.link.wire import Chunk
from resources.kv_buffers import KVBuffers


class TransferFailed(RuntimeError):
    """A KV transfer did not complete."""


class TransferBackend(Protocol):
    def send(self, src: KVBuffers, src_locs: torch.Tensor, dst_locs: torch.Tensor, request_id: str,
             destination: Any = None) -> None:
        """Copy the K/V at `src_locs` of every layer to `dst_locs` on the receiving side (or
        into `destination`, a `engine.disagg.decode.destination.KVDestination`); return when the
        copy has landed, raise TransferFailed if it cannot."""


class LoopbackTransfer:
    """In-process transfer: a real copy between two engines' KV buffers."""

    def __init__(self, dst: KVBuffers, faults: Any = None) -> None:
        self.dst = dst
        self.faults = faults
        self.stream = torch.cuda.Stream() if dst.k[0].is_cuda else None

    def send(self, src: KVBuffers, src_locs: torch.Tensor, dst_locs: torch.Tensor, request_id: str,
             destination: Any = None) -> None:
        if self.faults is not None and self.faults.transfer_fails(request_id):
            raise TransferFailed(f"injected transfer failure for {request_id!r}")
        if destination is not None:  # HiSparse host rows: one chunk of every layer and token
            kv = torch.stack([torch.stack((src.k[layer][src_locs], src.v[layer][src_locs]))
                              for layer in range(src.num_layers)])
            destination.write(Chunk(0, src.num_layers, 0, int(src_locs.numel()), kv.numel() * kv.element_size()), kv)
            return
        dst_locs = dst_locs.to(self.dst.k[0].device)
        if self.stream is None:
            self._copy(src, src_locs, dst_locs)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._copy(src, src_locs, dst_locs)
        event = torch.cuda.Event()
        event.record(self.stream)
        event.synchronize()

    def _copy(self, src: KVBuffers, src_locs: torch.Tensor, dst_locs: torch.Tensor) -> None:
        for layer in range(src.num_layers):
            self.dst.k[layer].index_copy_(0, dst_locs, src.k[layer][src_locs].to(self.dst.k[layer].dtype))
            self.dst.v[layer].index_copy_(0, dst_locs, src.v[layer][src_locs].to(self.dst.v[layer].dtype))

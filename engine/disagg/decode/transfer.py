"""KV transfer backends: how a prefill's K/V reaches the decode side's pages.

`TransferBackend.send` copies the K/V of every layer at some source
locations to destination locations on the receiving side and returns when
the copy has landed (or raises `TransferFailed`). `LoopbackTransfer` is the
in-process backend: a real copy between two engines' KV buffers, on a side
stream of the destination's device on CUDA that first waits for the compute
stream, and is waited for (an event) before `send` returns: the transfer's
fence completes after the copy, never while it is only queued.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.disagg.decode.destination import SideStream
from engine.disagg.link.wire import Chunk
from resources.device_io import on_device
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
        self.device = dst.k[0].device
        self._copy = SideStream(self.device)

    def send(self, src: KVBuffers, src_locs: torch.Tensor, dst_locs: torch.Tensor, request_id: str,
             destination: Any = None) -> None:
        if self.faults is not None and self.faults.transfer_fails(request_id):
            raise TransferFailed(f"injected transfer failure for {request_id!r}")
        with on_device(self.device):
            if destination is not None:  # HiSparse host rows: one chunk of every layer and token
                kv = torch.stack([torch.stack((src.k[layer][src_locs], src.v[layer][src_locs]))
                                  for layer in range(src.num_layers)])
                nbytes = kv.numel() * kv.element_size()
                destination.write(Chunk(0, src.num_layers, 0, int(src_locs.numel()), nbytes), kv)
                return
            dst_locs = dst_locs.to(self.device)
            self._copy.run(dst_locs, self.device, lambda locs: self._write(src, src_locs, locs))

    def _write(self, src: KVBuffers, src_locs: torch.Tensor, dst_locs: torch.Tensor) -> None:
        for layer in range(src.num_layers):
            self.dst.k[layer].index_copy_(0, dst_locs, src.k[layer][src_locs].to(self.dst.k[layer].dtype))
            self.dst.v[layer].index_copy_(0, dst_locs, src.v[layer][src_locs].to(self.dst.v[layer].dtype))

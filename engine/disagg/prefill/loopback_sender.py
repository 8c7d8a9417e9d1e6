"""The in-process prefill's sender: a real copy of the KV into the decode side's memory.

The decode side's `kv_transfer` hook gives each job its destination (the
request's KV pages, or HiSparse's host rows); this sender copies the
prefill's K/V of every layer there on its own thread, under the engine's
device (on CUDA the destination writes on its side stream, after the compute
stream's work, and waits for an event before returning), then resolves the
job with the first token and completes the send's fence. Faults: `fail_transfer`
makes the copy fail; a stuck `kv_transfer` fence makes the copy "never land"
on both sides until `FaultInjector.unstick()`.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.disagg.decode.destination import PagedDestination
from engine.disagg.decode.kv_transfer_hook import TRANSFER_FENCE, TransferCancelled
from engine.disagg.decode.transfer import TransferFailed
from engine.disagg.link.staging import StagingPool
from engine.disagg.link.wire import Chunk
from engine.disagg.prefill.send import SEND_FENCE, SendQueue, SendRecord
from resources.device_io import on_device
from resources.fences import ManualFence
from resources.kv_buffers import KVBuffers


class LoopbackSender:
    """`KVSender` for the decode role's in-process prefill."""

    staging: StagingPool | None = None

    def __init__(self, src: KVBuffers, *, fence_timeout: float, faults: Any = None) -> None:
        self.src = src
        self.device = src.k[0].device
        self.fence_timeout = fence_timeout
        self.faults = faults
        self.queue = SendQueue("kvlife-loopback-send")

    def start(self, record: SendRecord) -> None:
        job = record.job
        if self.faults is not None and self.faults.fence_stuck(TRANSFER_FENCE, job.request_id):
            # the copy does not land in time: both sides' fences miss their deadlines until `unstick()`
            record.pages_fence = self.faults.stuck_fence(SEND_FENCE, {"kv"}, timeout=self.fence_timeout)
            self.faults.stuck.append(job.fence)
            job.resolve("ok", record.first, landed=False)
            return
        fence = ManualFence(SEND_FENCE, {"kv"}, timeout=self.fence_timeout)
        record.pages_fence = fence
        self.queue.submit(lambda: self._send(record, fence))

    def close(self) -> None:
        self.queue.close()

    def _send(self, record: SendRecord, fence: ManualFence) -> None:
        job = record.job
        try:
            if job.cancelled:
                raise TransferCancelled(f"{job.request_id!r} cancelled before its KV was sent")
            if self.faults is not None and self.faults.transfer_fails(job.request_id):
                raise TransferFailed(f"injected transfer failure for {job.request_id!r}")
            self._copy(record.src_locs, job.destination)
        except Exception as exc:  # noqa: BLE001 - answered, never lost
            job.resolve("failed", exc)
        else:
            job.resolve("ok", record.first)
        finally:
            fence.complete()

    def _copy(self, src_locs: torch.Tensor, destination: Any) -> None:
        src = self.src
        with on_device(self.device):
            if isinstance(destination, PagedDestination):  # page to page: per layer one gather, one scatter
                destination.copy_from(src, src_locs)
                return
            # HiSparse's host rows (or any destination): one chunk of every layer and token
            kv = torch.stack([torch.stack((src.k[layer][src_locs], src.v[layer][src_locs]))
                              for layer in range(src.num_layers)])
            destination.write(Chunk(0, src.num_layers, 0, int(src_locs.numel()), kv.numel() * kv.element_size()), kv)

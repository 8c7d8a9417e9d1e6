"""The prefill server's sender: gather a request's KV into staging for its link.

On its own thread, per job (`PrefillServer` looks the job's link up by its
worker id): the KV of every layer at the request's token locations is
gathered into chunks of staging (`transfer.staging`; on CUDA with a host
backend, on the device and then to pinned memory on a side stream), recorded
in the `kv_send` handle's `SendRecord` as they are taken, and handed to the
link (`PrefillLink.attach`). Then the pages fence completes (the pages are
read), and the job is resolved with the first token, which tells the link to
send RESULT and the chunks; the link completes the wire fence when it is done
with them. A send that fails (no staging in time, the link gone, an injected
failure) completes both fences and resolves the job failed; the staging
taken so far is the record's, given back by the hook's release like the
rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from engine.disagg.decode.kv_transfer_hook import TransferCancelled
from engine.disagg.decode.transfer import TransferFailed
from engine.disagg.link.staging import StagingFull, StagingPool
from engine.disagg.link.wire import Chunk, KVLayout, chunk_plan
from engine.disagg.prefill.prefill_hooks import KV_SEND
from engine.disagg.prefill.prefill_link import ServerJob
from engine.disagg.prefill.send import SEND_FENCE, WIRE_FENCE, SendQueue, SendRecord
from resources.fences import ManualFence
from resources.kv_buffers import KVBuffers


class StagingSender:
    """`KVSender` of a prefill server (see the module docstring)."""

    def __init__(self, src: KVBuffers, staging: StagingPool, layout: KVLayout, *,
                 find_job: Callable[[str], ServerJob | None], chunk_slack: float, fence_timeout: float,
                 faults: Any = None) -> None:
        self.src = src
        self._staging = staging
        self.layout = layout
        self.find_job = find_job
        self.chunk_slack = chunk_slack
        self.fence_timeout = fence_timeout
        self.faults = faults
        self.stream: torch.cuda.Stream | None = None
        self.queue = SendQueue("kvlife-stage")

    @property
    def staging(self) -> StagingPool:
        return self._staging

    def start(self, record: SendRecord) -> None:
        record.owner = record.job.request_id
        record.pages_fence = pages = ManualFence(SEND_FENCE, {"kv"}, timeout=self.fence_timeout)
        record.wire_fence = ManualFence(WIRE_FENCE, {KV_SEND}, timeout=self.fence_timeout)
        sj = self.find_job(record.job.request_id)  # NOTE: on the event loop, where the server's table lives
        self.queue.submit(lambda: self._stage(record, sj, pages))

    def close(self) -> None:
        self.queue.close()

    def _stage(self, record: SendRecord, sj: ServerJob | None, pages: ManualFence) -> None:
        job = record.job
        try:
            if sj is None or sj.spec is None:
                raise TransferFailed(f"no link job {job.request_id!r}")
            spec = sj.spec
            if self.faults is not None and self.faults.transfer_fails(spec.request_id):
                raise TransferFailed(f"injected transfer failure for {spec.request_id!r}")
            if job.cancelled:
                raise TransferCancelled(f"{spec.request_id!r} cancelled before its KV was staged")
            if not sj.link.up:
                raise TransferFailed("the decode's link is down")
            device = sj.link.pair.data_device
            for chunk in chunk_plan(self.layout, int(record.src_locs.numel()), spec.max_chunk_bytes):
                wait = max(sj.deadline - time.monotonic(), self.chunk_slack)
                try:
                    buf = self._staging.take(record.owner, chunk.nbytes, timeout=wait, device=device)
                except StagingFull as exc:
                    raise TransferFailed(str(exc)) from exc
                record.staged.append((chunk, buf))
                self._gather(record.src_locs, chunk, buf.view(self.layout.dtype).view(self.layout.chunk_shape(chunk)))
            pages.complete()  # the pages are read
            if not sj.link.attach(sj, record):
                raise TransferFailed("the decode's link went down")
        except Exception as exc:  # noqa: BLE001 - answered, never lost
            pages.complete()
            record.wire_done()  # never posted: the staging taken so far may be reused
            job.resolve("failed", exc)
            return
        job.resolve("ok", record.first)  # the link sends RESULT and the chunks, then completes the wire fence

    def _gather(self, src_locs: torch.Tensor, chunk: Chunk, out: torch.Tensor) -> None:
        src = self.src
        locs = src_locs[chunk.start: chunk.start + chunk.count]
        if out.device == src.k[0].device:
            for i in range(chunk.num_layers):
                torch.index_select(src.k[chunk.first_layer + i], 0, locs, out=out[i, 0])
                torch.index_select(src.v[chunk.first_layer + i], 0, locs, out=out[i, 1])
            return
        # NOTE: device KV, host-memory backend: gather on the device, copy to pinned staging on a side stream
        if self.stream is None:
            self.stream = torch.cuda.Stream(src.k[0].device)
        self.stream.wait_stream(torch.cuda.current_stream(src.k[0].device))
        with torch.cuda.stream(self.stream):
            for i in range(chunk.num_layers):
                out[i, 0].copy_(src.k[chunk.first_layer + i].index_select(0, locs), non_blocking=True)
                out[i, 1].copy_(src.v[chunk.first_layer + i].index_select(0, locs), non_blocking=True)
        self.stream.synchronize()

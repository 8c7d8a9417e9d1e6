"""The prefill server's sender: hand a request's KV to its link, from its pages where it can.

Per job (`PrefillServer` looks the job's link up by its worker id), on the
event loop: when the link's data group reaches the KV buffers (host KV over
gloo, device KV over NCCL) and the request's page runs are long enough
(`LinkSettings.direct_min_run_bytes`), the link sends every message straight
from the KV pages (`SendRecord.views`: views of the buffers, one per layer,
K or V and run; `engine.disagg.link.messages`): the record goes to the link
at once and the job is resolved with the first token, which tells the link
to send RESULT and the messages. Nothing is copied, and the pages fence
(``kv_send``) stays open until the link is done with them (the last byte
has left, or the send failed and the pair is closed), so the request's KV
pages cannot be released while gloo still reads them.

Otherwise (the fallback: CUDA KV over gloo, or runs too short to be worth
a message each) the KV is gathered into chunks of staging
(`transfer.staging`; on CUDA with a host backend on the device and then to
pinned memory on a side stream) on the sender's own thread, recorded in the
`kv_send` handle's `SendRecord` as they are taken, and handed to the link;
then the pages fence completes (the pages are read), and the job is
resolved; the link completes the wire fence (``kv_wire``) when it is done
with the chunks.

A send that fails (no staging in time, the link gone, an injected failure)
completes its fences and resolves the job failed; the staging taken so far
is the record's, given back by the hook's release like the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from engine.disagg.decode.kv_transfer_hook import TransferCancelled
from engine.disagg.decode.transfer import TransferFailed
from engine.disagg.link.messages import Piece, direct_views, run_starts, staged_views, worth_direct
from engine.disagg.link.settings import DIRECT_MIN_RUN_BYTES
from engine.disagg.link.staging import StagingFull, StagingPool
from engine.disagg.link.wire import Chunk, JobSpec, KVLayout, chunk_plan
from engine.disagg.prefill.prefill_hooks import KV_SEND
from engine.disagg.prefill.prefill_link import ServerJob
from engine.disagg.prefill.send import SEND_FENCE, WIRE_FENCE, SendQueue, SendRecord
from resources.fences import ManualFence
from resources.kv_buffers import KVBuffers


class LinkSender:
    """`KVSender` of a prefill server (see the module docstring)."""

    def __init__(self, src: KVBuffers, staging: StagingPool, layout: KVLayout, *,
                 find_job: Callable[[str], ServerJob | None], chunk_slack: float, fence_timeout: float,
                 direct_min_run_bytes: int = DIRECT_MIN_RUN_BYTES, faults: Any = None) -> None:
        self.src = src
        self._staging = staging
        self.layout = layout
        self.find_job = find_job
        self.chunk_slack = chunk_slack
        self.fence_timeout = fence_timeout
        self.direct_min_run_bytes = direct_min_run_bytes
        self.faults = faults
        self.stream: torch.cuda.Stream | None = None
        self.queue = SendQueue("kvlife-stage")

    @property
    def staging(self) -> StagingPool:
        return self._staging

    def start(self, record: SendRecord) -> None:
        job = record.job
        record.owner = job.request_id
        record.pages_fence = pages = ManualFence(SEND_FENCE, {"kv"}, timeout=self.fence_timeout)
        sj = self.find_job(job.request_id)  # NOTE: on the event loop, where the server's table lives
        try:
            spec = self._check(record, sj)
            assert sj is not None
            record.plan = chunk_plan(self.layout, int(record.src_locs.numel()), spec.max_chunk_bytes)
            starts = self._direct_runs(record, sj)
            if starts is not None:  # the link sends from the pages: the pages fence is the wire's
                record.src_runs, record.wire_fence = starts, pages
                record.views = self._page_views(record)
                if not sj.link.attach(sj, record):
                    raise TransferFailed("the decode's link went down")
                job.resolve("ok", record.first)
                return
        except Exception as exc:  # noqa: BLE001 - answered, never lost
            record.wire_fence = None
            pages.complete()
            job.resolve("failed", exc)
            return
        record.wire_fence = ManualFence(WIRE_FENCE, {KV_SEND}, timeout=self.fence_timeout)
        self.queue.submit(lambda: self._stage(record, sj, pages))

    def close(self) -> None:
        self.queue.close()

    def _check(self, record: SendRecord, sj: ServerJob | None) -> JobSpec:
        """The job's spec, or why it cannot be sent."""
        job = record.job
        if sj is None or sj.spec is None:
            raise TransferFailed(f"no link job {job.request_id!r}")
        spec = sj.spec
        if self.faults is not None and self.faults.transfer_fails(spec.request_id):
            raise TransferFailed(f"injected transfer failure for {spec.request_id!r}")
        if job.cancelled:
            raise TransferCancelled(f"{spec.request_id!r} cancelled before its KV was sent")
        if not sj.link.up:
            raise TransferFailed("the decode's link is down")
        return spec

    def _direct_runs(self, record: SendRecord, sj: ServerJob) -> list[int] | None:
        """The run starts of the request's pages if the link sends straight from them, else None."""
        if record.host_locs is None or self.src.k[0].device != sj.link.pair.data_device:
            return None
        starts = run_starts(record.host_locs)
        if not worth_direct(self.layout, len(record.host_locs), starts, self.direct_min_run_bytes):
            return None
        return starts

    def _page_views(self, record: SendRecord) -> Callable[[int, Chunk, list[Piece]], list[torch.Tensor]]:
        src, locs = self.src, record.host_locs
        assert locs is not None
        return lambda index, chunk, pieces: direct_views(src.k, src.v, locs, pieces)

    # --------------------------------------------------------- the fallback
    def _stage(self, record: SendRecord, sj: ServerJob | None, pages: ManualFence) -> None:
        job = record.job
        try:
            self._check(record, sj)
            assert sj is not None and sj.spec is not None
            device = sj.link.pair.data_device
            for chunk in record.plan:
                wait = max(sj.deadline - time.monotonic(), self.chunk_slack)
                try:
                    buf = self._staging.take(record.owner, chunk.nbytes, timeout=wait, device=device)
                except StagingFull as exc:
                    raise TransferFailed(str(exc)) from exc
                record.staged.append((chunk, buf))
                self._gather(record.src_locs, chunk, buf.view(self.layout.dtype).view(self.layout.chunk_shape(chunk)))
            layout, staged = self.layout, record.staged
            record.views = lambda index, chunk, pieces: staged_views(layout, chunk, staged[index][1], pieces)
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

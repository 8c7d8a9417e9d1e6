"""A prefill's staged send gives its staging memory back at the `kv_send` hook's release, for real: no
reference to a staged buffer outlives that release (the link's `views` of them included), so a buffer the
pool does not keep is freed then, not whenever the garbage collector reaches a cycle holding the record.
Before, a prefill staging 125 MiB jobs grew by several GB of resident memory over a few rounds."""

from __future__ import annotations

import gc
import time
import types
import weakref

import torch

from engine.config import SamplingParams
from engine.disagg.decode.kv_transfer_hook import FirstToken, TransferJob
from engine.disagg.link.staging import StagingPool
from engine.disagg.link.wire import JobSpec
from engine.disagg.prefill.link_sender import LinkSender
from engine.disagg.prefill.prefill_hooks import KVSendHook
from engine.disagg.prefill.prefill_link import ServerJob
from engine.disagg.prefill.send import SendRecord
from resources.fences import ManualFence
from resources.kv_buffers import KVBuffers
from states import Handle
from test_disagg_link import LAYOUT, TOKENS


class _Link:
    """The decode's side of the link as the sender sees it: up, reaching host memory, taking each record."""

    up = True
    pair = types.SimpleNamespace(data_device=torch.device("cpu"))

    def attach(self, sj: ServerJob, record: SendRecord) -> bool:
        sj.send = record
        return True


def test_a_staged_sends_buffers_are_freed_by_its_release():
    buffers = KVBuffers(num_layers=LAYOUT.num_layers, num_pages=8, page_size=4, num_kv_heads=LAYOUT.num_kv_heads,
                        head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, device="cpu")
    staging = StagingPool("transfer.staging", 1 << 20, torch.device("cpu"), keep_bytes=0)  # keeps nothing
    now = time.monotonic()
    # NOTE: chunks of at most 1 KiB: four of them (two per layer), each staged in a buffer of its own
    spec = JobSpec("r1", list(range(TOKENS)), {}, max_chunk_bytes=1024)
    sj = ServerJob(_Link(), 1, spec, now, now + 30.0)
    sender = LinkSender(buffers, staging, LAYOUT, find_job=lambda rid: sj, chunk_slack=1.0, fence_timeout=30.0)
    job = TransferJob("r1", spec.token_ids, [], SamplingParams(), [], torch.arange(TOKENS),
                      ManualFence("kv_transfer", {"kv"}, timeout=30.0), 30.0)
    record = SendRecord(job, FirstToken(7, None), src_locs=torch.arange(TOKENS))  # no host locations: staged
    gc_was_on = gc.isenabled()
    gc.disable()  # NOTE: what frees the buffers must be the release itself
    try:
        sender.start(record)
        deadline = time.monotonic() + 10
        while not (record.pages_fence.done() and job.outcome is not None) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.outcome[0] == "ok" and len(record.staged) == 4 and record.views is not None
        assert staging.held == sum(chunk.nbytes for chunk in record.plan) > 0
        views = record.views(0, record.plan[0], [])  # what the link would send: views of the staged chunks
        del views
        alive = [weakref.ref(buf) for _chunk, buf in record.staged]
        record.wire_done()  # the link has sent everything
        handle = Handle("kv_send", "r1", record)
        handle.mark_released()  # NOTE: as the machine does before a hook's release
        KVSendHook(sender, kv_pool=None).release(None, handle)
        assert staging.held == 0
        assert [ref() for ref in alive] == [None] * 4, "a staged buffer outlived its release"
    finally:
        if gc_was_on:
            gc.enable()
        sender.close()

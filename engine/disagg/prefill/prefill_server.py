"""`PrefillServer`: the prefill role in its own process.

    async with PrefillServer(EngineConfig(...), PrefillServerConfig(bootstrap_port=31001)) as server:
        await server.wait_closed()   # or: serve_prefill(...) for the HTTP routes too

It runs the same `PrefillWorker` as the in-process decode role, over its own
pools and machine, with a transfer backend that stages the KV for a link
instead of copying it into local buffers. Decodes connect through the
bootstrap store (`engine.disagg.link.bootstrap`); each gets a `PrefillLink`.

A job's path: the link's control thread receives it -> `submit_job` (on
this event loop) gives the worker a TransferJob -> the worker prefills and
calls `LinkTransfer.send`, which gathers the KV into staging -> the worker
sets the outcome and completes the fence -> the link's sending thread sends
the answer and the chunks. A job over its compute budget, cancelled by the
decode, or whose link went down is cancelled in the worker, which finishes
and releases its request through the machine as it does for any abort.

When nothing is in flight the server runs its idle leak check (pools and
ledger, as an Engine does) and counts the result (`leak_checks`,
`leak_check_failures`).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs
import structlog
import torch
import torch.distributed as dist

from engine.config import EngineConfig, SamplingParams
from engine.disagg.link.bootstrap import BootstrapServer
from engine.disagg.decode.kv_transfer_hook import TransferJob
from engine.disagg.link.observability import TransferStats
from engine.disagg.prefill.prefill_link import PrefillLink, ServerJob
from engine.disagg.prefill.prefill_worker import PrefillWorker
from engine.disagg.link.settings import PrefillServerConfig, SECRET_ENV
from engine.disagg.link.staging import StagingFull, StagingPool
from engine.disagg.decode.transfer import TransferFailed
from engine.disagg.link.transport import LinkError, Pair
from engine.disagg.link.wire import KVLayout, chunk_plan, compatibility_record, model_identity
from resources import ManualFence
from resources.ledger import LeakError, check_memory, memory_report

log = structlog.get_logger("kvlife.transfer")
TICK = 0.02


def _dial(host: str) -> str:
    """The address to reach a store bound to `host` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host


class _SignalledFence(ManualFence):
    """The worker's job fence; completing it tells the server the outcome is known."""

    def __init__(self, on_complete: Any, timeout: float) -> None:
        super().__init__("kv_send", {"kv"}, timeout=timeout, armed=False)
        self._on_complete = on_complete

    def complete(self) -> None:
        super().complete()
        self._on_complete()


class LinkTransfer:
    """The worker's TransferBackend: stage a job's KV for its link (in the worker's thread)."""

    def __init__(self, server: PrefillServer) -> None:
        self.server = server
        self.stream: torch.cuda.Stream | None = None

    def send(self, src: Any, src_locs: torch.Tensor, dst_locs: torch.Tensor, request_id: str,
             destination: Any = None) -> None:
        # NOTE: the destination is the decode side's (it picked it when it sent the job)
        server = self.server
        sj = server.by_worker_id.get(request_id)
        if sj is None:
            raise TransferFailed(f"no link job {request_id!r}")
        spec = sj.spec
        assert spec is not None  # a job reaches the worker only once it parsed
        if server.faults is not None and server.faults.transfer_fails(spec.request_id):
            raise TransferFailed(f"injected transfer failure for {spec.request_id!r}")
        if not sj.link.up:
            raise TransferFailed("the decode's link is down")
        layout, staged = server.layout, []
        to_device = sj.link.pair.data_device
        try:
            for chunk in chunk_plan(layout, int(src_locs.numel()), spec.max_chunk_bytes):
                wait = max(sj.deadline - time.monotonic(), server.settings.chunk_slack)
                buf = server.staging.take(sj.worker_id, chunk.nbytes, timeout=wait, device=to_device)
                staged.append((chunk, buf))
                self._gather(src, src_locs, chunk, buf.view(layout.dtype).view(layout.chunk_shape(chunk)))
        except StagingFull as exc:
            self._give(sj, staged)
            raise TransferFailed(str(exc)) from exc
        if not sj.link.attach(sj, staged):
            self._give(sj, staged)
            raise TransferFailed("the decode's link went down")

    def _gather(self, src: Any, src_locs: torch.Tensor, chunk: Any, out: torch.Tensor) -> None:
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

    def _give(self, sj: ServerJob, staged: list) -> None:
        for _chunk, buf in staged:
            self.server.staging.give(sj.worker_id, buf)


class PrefillServer:
    """See the module docstring. `test_points(name, request_id, index)` is for tests only."""

    def __init__(self, config: EngineConfig, settings: PrefillServerConfig | None = None, *, faults: Any = None,
                 test_points: Any = None) -> None:
        from engine.runtime.assembly import build_parts

        self.config = attrs.evolve(config, disaggregation="none", hisparse=None, remote_prefill=None)
        self.settings = settings or PrefillServerConfig()
        self.faults = faults
        self.test_points = test_points
        self.parts = build_parts(self.config, faults=faults)
        mc = self.parts.model_config
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.parts.kv_buffers.k[0].dtype)
        self.record = compatibility_record(model_identity=model_identity(mc, self.config), layout=self.layout,
                                           page_size=self.config.page_size, backend=self.settings.backend)
        self.worker = PrefillWorker(self.parts, LinkTransfer(self), faults=faults)
        self.stats = TransferStats("prefill")
        self.staging = StagingPool("transfer.staging", self.settings.staging_bytes, self.parts.device)
        self.pools = [*self.parts.pools, self.staging]
        self.links: list[PrefillLink] = []
        self.by_worker_id: dict[str, ServerJob] = {}
        self.leak_checks = 0
        self.leak_check_failures = 0
        self.bootstrap: BootstrapServer | None = None
        self._token: Any = None
        self._closing = threading.Event()
        self._task_group: Any = None
        self._was_idle = True
        self._loop_thread = 0

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> PrefillServer:
        self._token = anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        self.bootstrap = BootstrapServer(self.settings, self.settings.bootstrap_port, self.record, log,
                                         on_refused=self.stats.count_refused)
        if self.settings.secret is None:
            log.warning("transfer.no_secret", message=f"no shared secret ({SECRET_ENV}): accepting decodes on "
                        "loopback addresses only", host=self.settings.host)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        await self._task_group.start(self.worker.run)
        self._task_group.start_soon(self._housekeeping)
        threading.Thread(target=self._accept_loop, args=(self.bootstrap,), name="kvlife-bootstrap", daemon=True).start()
        log.info("transfer.prefill_started", host=self.settings.host, bootstrap_port=self.bootstrap_port,
                 boot=self.bootstrap.boot, model=self.record["model"])
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._closing.set()
        with anyio.CancelScope(shield=True):
            links = list(self.links)
            for link in links:
                link.down(LinkError("shutdown", "the prefill is shutting down"))
            with anyio.move_on_after(self.config.fence_timeout):
                await self.worker.close()
                while not self.idle:
                    await anyio.sleep(TICK)
            self._check_idle(force=True)
            # NOTE: no thread left inside a gloo wait at exit (a decode answers the goodbye at once)
            timeout = self.settings.liveness_timeout + self.settings.chunk_slack
            await anyio.to_thread.run_sync(lambda: [link.join(timeout) for link in links])
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(*exc_info)

    @property
    def bootstrap_port(self) -> int:
        return self.bootstrap.port if self.bootstrap is not None else self.settings.bootstrap_port

    @property
    def idle(self) -> bool:
        return self.worker.idle and not self.by_worker_id and self.staging.held == 0

    # ------------------------------------------------- called on the loop
    def call(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` on this server's event loop (from a link thread); dropped once it has closed."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
            return
        try:
            anyio.from_thread.run_sync(fn, *args, token=self._token)
        except RuntimeError:
            pass  # the event loop has gone: the process is exiting

    def submit_job(self, sj: ServerJob) -> None:
        spec = sj.spec
        assert spec is not None  # the link submits only the jobs that parsed
        sj.worker_id = f"{spec.request_id}@{sj.link.name}.{sj.tag}"
        try:
            params = SamplingParams(**spec.params)
        except Exception as exc:  # noqa: BLE001 - a decode of another version
            sj.error = f"bad sampling parameters: {exc}"
        vocab, limit = self.parts.model_config.vocab_size, self.parts.max_context
        if len(spec.token_ids) > limit or len(spec.output_token_ids) >= len(spec.token_ids):
            sj.error = f"{len(spec.token_ids)} tokens: this prefill takes 1 to {limit} (its max_context)"
        elif min(spec.token_ids) < 0 or max(spec.token_ids) >= vocab:
            sj.error = f"token ids must be in [0, {vocab})"
        if sj.error is not None:
            self._ready(sj)
            return
        prompt = spec.token_ids[: len(spec.token_ids) - len(spec.output_token_ids)]
        timeout = self.config.fence_timeout
        sj.job = TransferJob(sj.worker_id, prompt, list(spec.output_token_ids), params, spec.images,
                             torch.empty(0, dtype=torch.int64), _SignalledFence(lambda: self._ready(sj), timeout),
                             timeout)
        self.by_worker_id[sj.worker_id] = sj
        self._was_idle = False
        if self.test_points is not None:
            self.test_points("job", spec.request_id, sj.tag)
        self.worker.submit(sj.job)

    def cancel_job(self, sj: ServerJob, why: str) -> None:
        if why == "cancelled" and not sj.cancelled:  # the decode's CANCEL
            sj.cancelled = True
            self.stats.job_cancelled()
        if sj.job is not None and sj.job.outcome is None:
            self.worker.cancel(sj.job)  # resolved at once if not started; else before it sends

    def forget_job(self, sj: ServerJob) -> None:
        self.by_worker_id.pop(sj.worker_id, None)

    def link_down(self, link: PrefillLink, jobs: list[ServerJob], error: LinkError) -> None:
        if link in self.links:
            self.links.remove(link)
            self.stats.link_down(link.name, error.cause)
        for sj in jobs:
            if sj.ready:
                self.forget_job(sj)
            else:
                self.cancel_job(sj, "link down")  # forgotten once the worker has finished it

    def _ready(self, sj: ServerJob) -> None:
        sj.ready = True
        if sj.link.up:
            sj.link.notify()
        else:
            self.forget_job(sj)

    def _add_link(self, link: PrefillLink) -> None:
        if self._closing.is_set():
            link.down(LinkError("shutdown", "the prefill is shutting down"))
            return
        self.links.append(link)
        assert self.bootstrap is not None  # links are built only after __aenter__ started it
        self.stats.link_up(link.name, link.epoch, self.bootstrap.boot)
        log.info("transfer.link_up", peer=link.name, epoch=link.epoch)
        link.start()

    # ------------------------------------------------------------ threads
    def _accept_loop(self, bootstrap: BootstrapServer) -> None:
        while not self._closing.is_set():
            try:
                done = bootstrap.poll()
            except Exception as exc:  # noqa: BLE001 - a broken client must not stop the acceptor
                log.warning("transfer.bootstrap_error", error=repr(exc))
                done = []
            for handshake in done:
                threading.Thread(target=self._build_link, args=(handshake,), daemon=True,
                                 name=f"kvlife-pair-{handshake.pair_id}").start()
            time.sleep(TICK)

    def _build_link(self, handshake: Any) -> None:
        s = self.settings
        if len(self.links) >= s.max_links:
            log.warning("transfer.refused", pair=handshake.pair_id, cause="capacity", reason="too many links")
            return
        try:
            # NOTE: a store client of its own: a TCPStore serializes its calls, and a rendezvous waits
            store = dist.TCPStore(_dial(s.host), self.bootstrap_port, None, False,
                                  datetime.timedelta(seconds=s.connect_timeout))
            pair = Pair(store, handshake.prefix, rank=0, host=s.host, backend=s.backend,
                        device=self.parts.device, timeout=s.connect_timeout)
        except Exception as exc:  # noqa: BLE001 - a decode that went away mid-handshake
            exc = exc if isinstance(exc, LinkError) else LinkError("timeout", str(exc).splitlines()[0][:200])
            log.warning("transfer.connect_failed", pair=handshake.pair_id, cause=exc.cause, error=str(exc))
            return
        link = PrefillLink(self, pair, f"decode#{handshake.pair_id}", s, epoch=handshake.pair_id)
        self.call(self._add_link, link)

    # ------------------------------------------------------- housekeeping
    async def _housekeeping(self) -> None:
        while True:
            now = time.monotonic()
            for sj in list(self.by_worker_id.values()):
                if not sj.ready and not sj.expired and sj.deadline <= now:
                    sj.expired = True
                    self.cancel_job(sj, "budget")
            self._check_idle()
            await anyio.sleep(TICK)

    def _check_idle(self, force: bool = False) -> None:
        if not self.idle or (self._was_idle and not force) or self.config.leak_check == "off":
            return
        self._was_idle = True
        self.leak_checks += 1
        try:
            check_memory(self.pools, self.parts.ledger, idle=True)
        except LeakError:
            self.leak_check_failures += 1

    # --------------------------------------------------------------- memory
    def memory_report(self):
        return memory_report(self.pools, self.parts.ledger, idle=self.idle)

    def check_memory(self):
        return check_memory(self.pools, self.parts.ledger, idle=self.idle)

    def debug(self) -> dict[str, Any]:
        """What /debug/memory shows: the memory report, the leak checks and the links."""
        report = self.memory_report().as_dict()
        report["leak_checks"] = {"runs": self.leak_checks, "failures": self.leak_check_failures,
                                 "idle_checked": self._was_idle}
        report["transfer"] = self.stats.snapshot()
        return report

"""`PrefillServer`: the prefill role in its own process.

    async with PrefillServer(EngineConfig(...), PrefillServerConfig(bootstrap_port=31001)) as server:
        await server.wait_closed()   # or: serve_prefill(...) for the HTTP routes too

It wraps the one runtime in the prefill role (`PrefillRuntime`, the same as
the in-process decode role's prefill, over pools of its own), whose sender
hands each request's KV to its link (`LinkSender`: sent from the KV pages,
staged only where it must be). Decodes connect through the bootstrap store
(`engine.disagg.link.bootstrap`); each gets a `PrefillLink`.

A job's path: the link's control thread receives it -> `submit_job` (on
this event loop) hands the runtime a `TransferJob` -> the runtime prefills
it in its batches, and its first token takes it to PREBUILT, where the
`kv_send` hook's acquisition starts the send -> the sender resolves the
job -> the link's sending thread sends the answer and the chunks (from the
KV pages, or from staging), then says it is done with them -> the request's
release, which waited for that, frees the pages (and gives any staging
back). A job over its compute budget, cancelled by the decode, or whose link
went down is cancelled in the runtime, which finishes and releases its
request through the machine as for any abort.

The leak check is the runtime's own: when nothing is in flight it checks the
prefill's pools (staging included) and counts the result (`leak_checks`,
`leak_check_failures`).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import attrs
from anyio.lowlevel import EventLoopToken
import structlog
import torch
import torch.distributed as dist

from engine.config import EngineConfig, SamplingParams
from engine.disagg.decode.kv_transfer_hook import TransferJob
from engine.disagg.link.bootstrap import BootstrapServer, Handshake
from engine.disagg.link.observability import TransferStats
from engine.disagg.link.settings import SECRET_ENV, PrefillServerConfig
from engine.disagg.link.staging import StagingPool
from engine.disagg.link.transport import LinkError, Pair
from engine.disagg.link.socket_transport import offered
from engine.disagg.link.wire import KVLayout, compatibility_record, transport_of, model_identity
from engine.disagg.prefill.prefill_link import PrefillLink, ServerJob
from engine.disagg.prefill.link_sender import LinkSender
from engine.model.loading import load_model
from engine.runtime.assembly import assemble, resolve_device
from engine.runtime.features.base import BuildContext
from engine.runtime.features.roles import PrefillRole
from engine.runtime.loop_waker import soon_on_loop
from engine.runtime.prefill_runtime import PrefillRuntime
from engine.testing import FaultInjector
from engine.thread_names import named_thread
from resources import ManualFence
from resources.ledger import MemoryReport

log = structlog.get_logger("kvlife.transfer")
TICK = 0.02
#: the bootstrap store's poll interval once no pair has been agreed for QUIET seconds
IDLE_POLL, QUIET = 0.1, 1.0


def _dial(host: str) -> str:
    """The address to reach a store bound to `host` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host


class _SignalledFence(ManualFence):
    """A job's fence on this side; completing it (the job is resolved) tells its link."""

    def __init__(self, on_complete: Callable[[], None], timeout: float) -> None:
        super().__init__("kv_send", {"kv"}, timeout=timeout, armed=False)
        self._on_complete = on_complete

    def complete(self) -> None:
        super().complete()
        self._on_complete()


class PrefillServer(anyio.AsyncContextManagerMixin):
    """See the module docstring. `test_points(name, request_id, index)` is for tests only."""

    def __init__(self, config: EngineConfig, settings: PrefillServerConfig | None = None, *,
                 faults: FaultInjector | None = None, test_points: Callable[[str, str, int], None] | None = None) -> None:
        self.config = attrs.evolve(config, disaggregation="none", hisparse=None, remote_prefill=None)
        self.settings = settings or PrefillServerConfig()
        self.faults = faults
        self.test_points = test_points
        device = resolve_device(self.config)
        self.staging = StagingPool("transfer.staging", self.settings.staging_bytes, device)
        self.by_worker_id: dict[str, ServerJob] = {}
        role = PrefillRole(self._sender)
        self.parts = assemble(self.config, device=device, bundle=load_model(self.config, device), role=role.install,
                              faults=faults)
        assert role.sender is not None  # set by its install
        self.runtime = PrefillRuntime(self.parts, inbox=role.inbox, sender=role.sender)
        mc = self.parts.model_config
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.parts.kv_buffers.k[0].dtype)
        self.record = compatibility_record(model_identity=model_identity(mc, self.config), layout=self.layout,
                                           page_size=self.config.page_size, backend=self.settings.backend,
                                           transport=offered(self.settings.backend, self.settings.transport))
        self.stats = TransferStats("prefill")
        self.pools = self.runtime.own_pools
        self.links: list[PrefillLink] = []
        self.bootstrap: BootstrapServer | None = None
        self._token: EventLoopToken | None = None
        self._closing = threading.Event()
        self._loop_thread = 0
        #: calls from other threads waiting for the event loop (`call`), and whether a drain is scheduled
        self._calls: deque[tuple[Callable[..., None], tuple[object, ...]]] = deque()
        self._calls_lock = threading.Lock()
        self._calls_scheduled = False

    def _sender(self, ctx: BuildContext) -> LinkSender:
        mc = ctx.model_config
        layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, ctx.kv_buffers.k[0].dtype)
        return LinkSender(ctx.kv_buffers, self.staging, layout, find_job=self.by_worker_id.get,
                          chunk_slack=self.settings.chunk_slack, fence_timeout=ctx.config.fence_timeout,
                          direct_min_run_bytes=self.settings.direct_min_run_bytes, faults=self.faults)

    # ------------------------------------------------------------ lifecycle
    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[PrefillServer]:
        self._token = anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        self.bootstrap = BootstrapServer(self.settings, self.settings.bootstrap_port, self.record, log,
                                         on_refused=self.stats.count_refused)
        if self.settings.secret is None:
            log.warning("transfer.no_secret", message=f"no shared secret ({SECRET_ENV}): accepting decodes on "
                        "loopback addresses only", host=self.settings.host)
        async with anyio.create_task_group() as tg:
            await tg.start(self.runtime.run)
            tg.start_soon(self._expire_jobs)
            named_thread(self._accept_loop, args=(self.bootstrap,), name="kvlife-bootstrap").start()
            log.info("transfer.prefill_started", host=self.settings.host, bootstrap_port=self.bootstrap_port,
                     boot=self.bootstrap.boot, model=self.record["model"])
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    await self._shut_down()
                tg.cancel_scope.cancel()

    async def _shut_down(self) -> None:
        self._closing.set()
        links = list(self.links)
        for link in links:
            link.down(LinkError("shutdown", "the prefill is shutting down"))
        with anyio.move_on_after(self.config.fence_timeout):
            await self.runtime.close()
        # NOTE: no thread left inside a gloo wait at exit (a decode answers the goodbye at once)
        timeout = self.settings.liveness_timeout + self.settings.chunk_slack
        await anyio.to_thread.run_sync(lambda: [link.join(timeout) for link in links])

    @property
    def bootstrap_port(self) -> int:
        return self.bootstrap.port if self.bootstrap is not None else self.settings.bootstrap_port

    @property
    def idle(self) -> bool:
        return self.runtime.idle and not self.by_worker_id

    @property
    def live_requests(self) -> int:
        """Prefill requests not yet released."""
        return self.runtime.loop.num_live

    @property
    def leak_checks(self) -> int:
        return self.runtime.loop.stats.leak_checks

    @property
    def leak_check_failures(self) -> int:
        return self.runtime.loop.stats.leak_check_failures

    # ------------------------------------------------- called on the loop
    def call(self, fn: Callable[..., None], *args: object) -> None:
        """Run `fn(*args)` on this server's event loop: at once on its thread, else soon, in the order of
        the calls, without waiting (a link's thread goes back to its socket); dropped once it has closed."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
            return
        with self._calls_lock:
            self._calls.append((fn, args))
            if self._calls_scheduled:
                return  # the drain already scheduled runs it
            self._calls_scheduled = True
        try:
            soon_on_loop(self._token, self._run_calls)
        except RuntimeError:
            pass  # the event loop has gone: the process is exiting

    def _run_calls(self) -> None:
        """On the loop: the calls queued so far, in order (one wake-up for a burst of jobs). Calls queued
        meanwhile run in the next drain, after what these woke (the runtime starts on the first jobs while
        the rest of a burst arrives)."""
        with self._calls_lock:
            calls = list(self._calls)
            self._calls.clear()
        for fn, args in calls:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - one bad call must not stop the others
                log.error("transfer.call_failed", call=getattr(fn, "__name__", repr(fn)), error=repr(exc))
        with self._calls_lock:
            if not self._calls:
                self._calls_scheduled = False
                return
        try:
            soon_on_loop(self._token, self._run_calls)
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
        limit = self.parts.max_context  # NOTE: the token ids' range was checked by the link's thread (`decode_job`)
        if len(spec.token_ids) > limit or len(spec.output_token_ids) >= len(spec.token_ids):
            sj.error = f"{len(spec.token_ids)} tokens: this prefill takes 1 to {limit} (its max_context)"
        if sj.error is not None:
            self._ready(sj)
            return
        prompt = spec.token_ids[: len(spec.token_ids) - len(spec.output_token_ids)]
        timeout = self.config.fence_timeout
        sj.job = TransferJob(sj.worker_id, prompt, list(spec.output_token_ids), params, spec.images,
                             torch.empty(0, dtype=torch.int64),
                             _SignalledFence(lambda: self.call(self._ready, sj), timeout), timeout)
        self.by_worker_id[sj.worker_id] = sj
        if self.test_points is not None:
            self.test_points("job", spec.request_id, sj.tag)
        self.runtime.submit(sj.job)

    def cancel_job(self, sj: ServerJob, why: str) -> None:
        if why == "cancelled" and not sj.cancelled:  # the decode's CANCEL
            sj.cancelled = True
            self.stats.job_cancelled()
        if sj.job is not None and sj.job.outcome is None:
            self.runtime.cancel(sj.job)  # answered at once if not admitted; else once nothing writes

    def forget_job(self, sj: ServerJob) -> None:
        """Drop an answered job from the table (from any thread: one atomic dict operation; its only lookup,
        by its send, came before it was answered)."""
        self.by_worker_id.pop(sj.worker_id, None)

    def link_down(self, link: PrefillLink, jobs: list[ServerJob], error: LinkError) -> None:
        if link in self.links:
            self.links.remove(link)
            self.stats.link_down(link.name, error.cause)
        for sj in jobs:
            if sj.ready:
                self.forget_job(sj)
            else:
                self.cancel_job(sj, "link down")  # forgotten once its request has answered it

    def _ready(self, sj: ServerJob) -> None:
        sj.ready = True
        if sj.link.up:
            sj.link.notify()
        else:
            self.forget_job(sj)

    def _add_link(self, link: PrefillLink) -> None:
        if self._closing.is_set():
            link.down(LinkError("shutdown", "the prefill is shutting down"))
            link.pair.leave()  # NOTE: never started: no thread of it will close the pair
            return
        self.links.append(link)
        assert self.bootstrap is not None  # links are built only once the server runs
        self.stats.link_up(link.name, link.epoch, self.bootstrap.boot, link.pair.transport)
        log.info("transfer.link_up", peer=link.name, epoch=link.epoch, transport=link.pair.transport)
        link.start()

    # ------------------------------------------------------------ threads
    def _accept_loop(self, bootstrap: BootstrapServer) -> None:
        active = time.monotonic()  # the last time a pair was being agreed
        while not self._closing.is_set():
            try:
                done = bootstrap.poll()
            except Exception as exc:  # noqa: BLE001 - a broken client must not stop the acceptor
                log.warning("transfer.bootstrap_error", error=repr(exc))
                done = []
            for handshake in done:
                named_thread(self._build_link, args=(handshake,), name=f"kvlife-pair-{handshake.pair_id}").start()
            now = time.monotonic()
            if done or bootstrap.handshaking:
                active = now
            # NOTE: each poll is a round trip to the bootstrap store: every TICK while pairs are being agreed,
            # every IDLE_POLL once quiet (a new decode's hello waits that much longer, the rest is unchanged)
            time.sleep(TICK if now - active < QUIET else IDLE_POLL)

    def _build_link(self, handshake: Handshake) -> None:
        s = self.settings
        if len(self.links) >= s.max_links:
            log.warning("transfer.refused", pair=handshake.pair_id, cause="capacity", reason="too many links")
            return
        try:
            # NOTE: a store client of its own: a TCPStore serializes its calls, and a rendezvous waits
            store = dist.TCPStore(_dial(s.host), self.bootstrap_port, None, False,
                                  datetime.timedelta(seconds=s.connect_timeout))
            pair = Pair(store, handshake.prefix, rank=0, host=s.host, backend=s.backend,
                        device=self.parts.device, timeout=s.connect_timeout,
                        transport=transport_of(self.record, handshake.peer_record))
        except Exception as exc:  # noqa: BLE001 - a decode that went away mid-handshake
            exc = exc if isinstance(exc, LinkError) else LinkError("timeout", str(exc).splitlines()[0][:200])
            log.warning("transfer.connect_failed", pair=handshake.pair_id, cause=exc.cause, error=str(exc))
            return
        link = PrefillLink(self, pair, f"decode#{handshake.pair_id}", s, epoch=handshake.pair_id,
                           vocab_size=self.parts.model_config.vocab_size)
        self.call(self._add_link, link)

    # --------------------------------------------------- compute budgets
    async def _expire_jobs(self) -> None:
        """Cancel jobs past their compute budget (the decode has given them up by then)."""
        while True:
            now = time.monotonic()
            for sj in list(self.by_worker_id.values()):
                if not sj.ready and not sj.expired and sj.deadline <= now:
                    sj.expired = True
                    self.cancel_job(sj, "budget")
            await anyio.sleep(TICK)

    # --------------------------------------------------------------- memory
    def memory_report(self) -> MemoryReport:
        return self.runtime.memory_report()

    def check_memory(self) -> MemoryReport:
        return self.runtime.check_memory()

    def debug(self) -> dict[str, Any]:
        """What /debug/memory shows: the memory report, the leak checks and the links."""
        report = self.memory_report().as_dict()
        loop = self.runtime.loop
        report["leak_checks"] = {"runs": loop.stats.leak_checks, "failures": loop.stats.leak_check_failures,
                                 "idle_checked": loop.checked_idle}
        report["transfer"] = self.stats.snapshot()
        return report

"""`RemotePrefillClient`: the decode role's prefill client over prefill servers
in other processes and on other nodes (EngineConfig.remote_prefill).

It implements the PrefillClient seam (`submit`, `cancel`, `unavailable`,
`run`, `idle`, `pools`): `submit` queues the job on the live link with the
fewest jobs in flight. `run` keeps one link per peer: it dials, and when a
link goes down (the prefill died, hung, or left) it dials again every
`reconnect_interval` (doubling up to 8x while it fails), so a restarted
prefill on the same address is picked up again as a new epoch.

Dead peers cost at most the heartbeat bound (`LinkSettings.dead_peer_bound`):
a link that goes down takes no new job, and each of its jobs whose KV had
not landed is re-sent to another live peer (the same destination pages, so
the output is unchanged; at most once per peer), or, with none up, fails
TRANSFER_FAILED at once. While no peer is up, `unavailable()` says why, and
the decode admits nothing into TRANSFERRING: its waiting requests finish
TRANSFER_FAILED with that reason, holding no KV (and `Engine.health()` is
not ready).

Memory report: `transfer.staging` (chunk buffers, bytes) and one
`transfer.jobs[<peer>]` pool per peer (plus `[pending]`: jobs between two
links) whose owners are the requests waiting on that peer, so /debug/memory
names them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

import anyio
import structlog
import torch

from engine.disagg.link import bootstrap
from engine.disagg.decode.decode_link import DecodeLink
from engine.disagg.decode.link_job import LinkJob
from engine.disagg.decode.destination import KVDestination, PagedDestination
from engine.disagg.decode.kv_transfer_hook import TransferJob, cancel_unstarted
from engine.disagg.link.messages import reaches, worth_direct
from engine.disagg.link.observability import TransferStats
from engine.disagg.link.staging import StagingPool
from engine.disagg.link.transport import LinkError, Pair
from engine.disagg.link.socket_transport import offered
from engine.disagg.link.wire import (JobSpec, KVLayout, chunk_plan, compatibility_record, transport_of, model_identity,
                                     params_to_dict)
from engine.errors import InvalidConfig
from resources.ledger import Owner, Pool, PoolUsage
from states import RequestState

log = structlog.get_logger("kvlife.transfer")
TICK = 0.02  # seconds between deadline checks


class _Peer:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.name = f"{host}:{port}"
        self.link: DecodeLink | None = None
        self.epoch = 0
        self.tried = False  # the first connect attempt is over
        self.refused: LinkError | None = None  # its last answer was a refusal (auth, incompatible)
        self.last_error = ""  # why it is not linked, for `unavailable`

    @property
    def up(self) -> bool:
        return self.link is not None and self.link.up

    def state(self) -> str:
        if self.link is not None and not self.link.up:
            return f"link down ({self.link.cause})"
        return self.last_error or "not linked yet"


class RemotePrefillClient:
    """See the module docstring."""

    def __init__(self, config: Any, model_config: Any, kv_buffers: Any, *, device: torch.device,
                 max_context: int) -> None:
        self.settings = config.remote_prefill
        self.kv_buffers = kv_buffers
        self.device = device
        self.layout = KVLayout(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                               kv_buffers.k[0].dtype)
        self.record = compatibility_record(model_identity=model_identity(model_config, config), layout=self.layout,
                                           page_size=config.page_size, backend=self.settings.backend,
                                           transport=offered(self.settings.backend, self.settings.transport))
        plan = chunk_plan(self.layout, max_context, self.settings.max_chunk_bytes)
        bound = self.settings.fence_bound([c.nbytes for c in plan])
        if config.fence_timeout < bound:
            raise InvalidConfig("EngineConfig.fence_timeout", f">= {bound:.2f} s, the longest a {max_context}-"
                                f"token transfer may take (first_timeout + {len(plan)} chunks at floor_bandwidth "
                                "+ chunk_slack each + margin)", config.fence_timeout)
        self.stats = TransferStats("decode")
        self.staging = StagingPool("transfer.staging", self.settings.staging_bytes, device)
        self.peers = [_Peer(host, port) for host, port in self.settings.addresses]
        #: jobs whose link went down, to re-send or fail (appended by link threads, taken on the loop)
        self.moving: deque[tuple[LinkJob, LinkError]] = deque()
        self._jobs: dict[int, LinkJob] = {}  # id(TransferJob) -> its LinkJob, until it ends
        self._turn = itertools.count()
        self._closing = False
        self._limiter = anyio.CapacityLimiter(len(self.peers))
        capacity = config.max_running
        self.pools: list[Pool] = [self.staging, *(_JobsPool(self, p.name, capacity) for p in self.peers),
                      _JobsPool(self, "pending", capacity)]

    # ----------------------------------------------------------- the seam
    def submit(self, job: TransferJob) -> None:
        destination = getattr(job, "destination", None)
        if destination is None or not hasattr(destination, "write"):
            destination = PagedDestination(self.kv_buffers, job.dst_locs)
        now = time.monotonic()
        spec = JobSpec(job.request_id, job.token_ids, params_to_dict(job.params), list(job.output_token_ids),
                       list(job.mm_inputs), max_chunk_bytes=self.settings.max_chunk_bytes,
                       runs=self._direct_runs(destination))
        lj = LinkJob(job, destination, chunk_plan(self.layout, destination.num_tokens, self.settings.max_chunk_bytes),
                     spec, now, now + self.settings.first_timeout)
        self._jobs[id(job)] = lj
        if self._closing:
            self.cancel(job)
        elif not self._dispatch(lj):  # every link went down since admission looked: fail now
            self._fail(lj, "no_link", self.unavailable() or "no prefill link is up")

    def _direct_runs(self, destination: KVDestination) -> list[int] | None:
        """The run starts of a destination that takes messages straight into its pages (memory the data
        group reaches, runs long enough: `LinkSettings.direct_min_run_bytes`); None: it receives into
        staging (HiSparse's host rows, CUDA pages over gloo, short runs)."""
        if not isinstance(destination, PagedDestination) or destination.device.type != reaches(self.settings.backend):
            return None
        starts: list[int] = destination.run_starts()
        if not worth_direct(self.layout, destination.num_tokens, starts, self.settings.direct_min_run_bytes):
            return None
        return starts

    def _dispatch(self, lj: LinkJob) -> bool:
        """Queue `lj` on the link with the fewest jobs; it starts then (its fence's deadline runs)."""
        link = self._pick()
        if link is None or not link.submit(lj):
            return False
        lj.deadline = time.monotonic() + self.settings.first_timeout
        lj.job.start()
        return True

    def cancel(self, job: TransferJob) -> None:
        """Give the job up: it resolves as soon as its receiving thread stops writing (at once between
        chunks; a job between two links when it is taken off the old one); the prefill is told."""
        lj = self._jobs.get(id(job))  # NOTE: kept until it has ended (`idle`); `_tick` drops it then
        if lj is None:
            cancel_unstarted(job)
            return
        job.cancelled = True
        if not lj.end(None, "cancelled", "cancelled by the decode", block=False):
            return
        self.stats.job_cancelled()
        log.info("transfer.cancelled", request_id=job.request_id, peer=lj.peer or None, epoch=lj.epoch)
        peer = next((p for p in self.peers if p.name == lj.peer), None)
        if peer is not None and peer.link is not None and peer.link.epoch == lj.epoch:
            peer.link.cancel(lj)

    def unavailable(self) -> str | None:
        """Why no job can be taken now (no link is up), naming each peer's state; None while one is up."""
        if any(p.up for p in self.peers):
            return None
        refusal = self._all_refused()
        if refusal is not None:
            return f"every prefill peer refused this decode: {refusal}"
        return "no prefill peer is up (" + "; ".join(f"{p.name}: {p.state()}" for p in self.peers) + ")"

    @property
    def idle(self) -> bool:
        """No job in flight, and no receiving thread still holds staging (it returns within its bound)."""
        return all(lj.done for lj in self._jobs.values()) and not self.moving and self.staging.held == 0

    async def close(self) -> None:
        """Cancel every job, say goodbye on every link and wait (bounded) for its threads to return."""
        self._closing = True
        for lj in list(self._jobs.values()):
            self.cancel(lj.job)
        links = [p.link for p in self.peers if p.link is not None]
        for link in links:
            link.close()
        timeout = self.settings.liveness_timeout + self.settings.chunk_slack
        await anyio.to_thread.run_sync(lambda: [link.join(timeout) for link in links])
        with anyio.move_on_after(timeout):  # a writing thread gives its staging back
            while not self.idle:
                self._move()  # jobs between two links resolve as cancelled
                await anyio.sleep(TICK)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self._limiter = anyio.CapacityLimiter(len(self.peers))  # NOTE: of the async library running it
        try:
            async with anyio.create_task_group() as tg:
                for peer in self.peers:
                    tg.start_soon(self._keep_connected, peer)
                with anyio.move_on_after(self.settings.connect_timeout):
                    while not all(peer.tried for peer in self.peers):
                        await anyio.sleep(TICK)
                task_status.started()
                while True:
                    self._tick(time.monotonic())
                    await anyio.sleep(TICK)
        finally:
            with anyio.CancelScope(shield=True):  # NOTE: no thread left inside a gloo wait at exit
                await self.close()

    async def wait_links(self, count: int | None = None, timeout: float = 10.0) -> None:
        """Wait until `count` links (default: one per peer) are up; TimeoutError otherwise."""
        want = len(self.peers) if count is None else count
        with anyio.fail_after(timeout):
            while sum(1 for p in self.peers if p.link is not None and p.link.up) < want:
                await anyio.sleep(TICK)

    def links(self) -> dict[str, dict[str, Any]]:
        """Each peer's link: up, epoch, jobs in flight."""
        return {p.name: {"up": p.link is not None and p.link.up, "epoch": p.epoch,
                         "jobs": p.link.load if p.link is not None else 0} for p in self.peers}

    # ------------------------------------------------------------ internals
    def _pick(self) -> DecodeLink | None:
        up = [p.link for p in self.peers if p.link is not None and p.link.up]
        if not up:
            return None
        start = next(self._turn) % len(up)
        rotated = up[start:] + up[:start]  # ties go round-robin
        return min(rotated, key=lambda link: link.load)

    def _all_refused(self) -> LinkError | None:
        """A refusal, if every peer's last answer was one (a configuration error: fail at once)."""
        if any(p.refused is None for p in self.peers):
            return None
        return self.peers[0].refused

    def _fail(self, lj: LinkJob, cause: str, why: str) -> None:
        if lj.end(None, cause, why, block=False):
            self.stats.job_failed(cause)
            log.warning("transfer.failed", request_id=lj.job.request_id, peer=lj.peer or None, epoch=lj.epoch,
                        cause=cause, error=why)

    def _failover(self, lj: LinkJob, error: LinkError) -> None:
        """A link that went down hands over a job it left unfinished (called from its threads)."""
        self.moving.append((lj, error))

    def _move(self) -> None:
        """Re-send each job whose link went down to the live link with the fewest jobs (at most once per
        peer), once its old link is not writing it; with none up (or closing), end it now."""
        for _ in range(len(self.moving)):
            old, error = self.moving.popleft()
            if old.writing():  # a chunk from the old link is being written: its pages are not free yet
                self.moving.append((old, error))
                continue
            job = old.job
            lj = old.successor(time.monotonic() + self.settings.first_timeout)
            self._jobs[id(job)] = lj
            if job.cancelled or self._closing:
                if lj.end(None, "cancelled", "cancelled by the decode", block=False):
                    self.stats.job_cancelled()
                continue
            if lj.attempt <= len(self.peers) and self._dispatch(lj):
                self.stats.count_failover(error.cause)
                log.info("transfer.failover", request_id=job.request_id, peer=old.peer, epoch=old.epoch,
                         cause=error.cause, to_peer=lj.peer, to_epoch=lj.epoch, attempt=lj.attempt)
                continue
            rest = "no other prefill peer is up" if self.unavailable() is not None else \
                f"it was already sent {old.attempt} times"
            self._fail(lj, error.cause, f"prefill {old.peer} (epoch {old.epoch}) went down ({error.cause}: {error}); "
                                        f"{rest}")

    def _tick(self, now: float) -> None:
        self._move()
        for peer in self.peers:
            if peer.link is not None:
                peer.link.expire(now)
        for key in [k for k, lj in self._jobs.items() if lj.done]:
            del self._jobs[key]

    async def _keep_connected(self, peer: _Peer) -> None:
        refused, failures = None, 0
        while True:
            failures += 1
            try:
                link = await anyio.to_thread.run_sync(self._connect, peer, abandon_on_cancel=True,
                                                      limiter=self._limiter)
            except bootstrap.PeerRefused as exc:
                peer.refused = exc
                self.stats.count_refused(exc.cause)
                if str(exc) != refused:  # say it once, not on every retry
                    log.error("transfer.refused", peer=peer.name, cause=exc.cause, error=str(exc))
                refused = str(exc)
                peer.last_error = f"refused: {exc}"
            except LinkError as exc:
                peer.last_error = f"cannot link ({exc.cause}): {exc}"
                log.debug("transfer.connect_failed", peer=peer.name, cause=exc.cause, error=str(exc))
            except Exception as exc:  # noqa: BLE001 - a bug here must not stop the engine
                peer.last_error = f"cannot link: {exc!r}"
                log.error("transfer.connect_failed", peer=peer.name, cause="transport", error=repr(exc))
            else:
                refused, failures = None, 0
                peer.refused = None
                peer.link = link
                peer.tried = True
                while link.up:
                    await anyio.sleep(TICK * 2)
                peer.last_error = f"link down ({link.cause})"
                peer.link = None
            peer.tried = True
            interval = self.settings.reconnect_interval  # doubling while it fails, up to 8x
            await anyio.sleep(interval * min(2 ** max(failures - 1, 0), 8))

    def _connect(self, peer: _Peer) -> DecodeLink:
        """Handshake and build the pair (in a worker thread)."""
        s = self.settings
        handshake = bootstrap.connect(peer.host, peer.port, s, self.record)
        pair = Pair(handshake.store, handshake.prefix, rank=1, host=s.host, backend=s.backend, device=self.device,
                    timeout=s.connect_timeout, transport=transport_of(self.record, handshake.peer_record))
        peer.epoch += 1
        link = DecodeLink(peer=peer.name, epoch=peer.epoch, boot=handshake.boot, pair=pair, settings=s,
                          layout=self.layout, stats=self.stats, staging=self.staging, failover=self._failover)
        link.start()
        self.stats.link_up(peer.name, peer.epoch, handshake.boot, pair.transport)
        log.info("transfer.link_up", peer=peer.name, epoch=peer.epoch, boot=handshake.boot, pair=handshake.pair_id,
                 transport=pair.transport)
        if self._closing:  # the engine left while this link was being built
            link.close()
        return link


class _JobsPool:
    """Jobs waiting on one peer (or between two links: "pending"), for the memory report."""

    def __init__(self, client: RemotePrefillClient, peer: str, capacity: int) -> None:
        self.name = f"transfer.jobs[{peer}]"
        self.unit = "jobs"
        self._client = client
        self._peer = peer
        self._capacity = capacity

    def _waiting(self) -> list[LinkJob]:
        if self._peer == "pending":
            return [lj for lj, _ in list(self._client.moving)]
        peer = next(p for p in self._client.peers if p.name == self._peer)
        return peer.link.jobs() if peer.link is not None else []

    def stats(self) -> PoolUsage:
        held = len(self._waiting())
        return PoolUsage(capacity=self._capacity, free=self._capacity - held, shared=held, unit="jobs")

    def shared_owners(self) -> list[Owner]:
        return [Owner(lj.job.request_id, RequestState.TRANSFERRING, None, 1) for lj in self._waiting()]

"""One link's transport: a private pair of groups (control, chunks) per prefill/decode pair.

Rank 0 is the prefill, rank 1 the decode. Control messages (headers, job
frames, keepalives) travel with CPU tensors on one group, KV chunks on a
second one (in host memory: on CUDA through pinned staging; with backend
"nccl", device tensors over NCCL), each on a connection of its own: on one
socket a job frame or a header waited behind the chunks before it. With
backend "gloo" the pair's `transport` says what carries both: "socket"
(`engine.disagg.link.socket_transport`: kvlife's own connections, driven by
native threads; where both sides offer it, `LinkSettings.transport`) or
"gloo" (two gloo groups). Gloo sends a message only once the peer has
posted its receive; the socket transport sends at once (the peer's kernel
holds the bytes until it posts).

Every wait has an explicit timeout. What gloo does on failure (measured in
SCALEOUT.md; the socket transport does the same, and its `abort` also ends a
waiting receive): a peer that dies with nothing in flight is seen at once
("Connection closed by peer"); one that dies mid-message only at the wait's
timeout; a timeout closes the pair, so nothing sent later lands. `abort()`
does not unblock a waiting receive, so a link is never reused after an
error: it is dropped and a new pair (a new epoch) is built. After a failed
wait, `Pair.abort` closes the pair at once and `drain` waits for none of the
other posted messages (each would otherwise run to its own timeout: a
prefill killed mid-chunk cost two chunk timeouts, not one).

NCCL (device chunks):

- connected eagerly: building the pair runs one warm-up transfer (rank 0 ->
  rank 1) within the connect timeout, so the communicator is up before the
  first job and a slow setup is a failed connect, not a dropped chunk;
- its own streams: sends and receives are posted from a send stream and a
  receive stream of the pair's device (the send stream first waits for the
  compute stream, which wrote the chunk); nothing makes the compute stream
  wait on a transfer, so decode steps never queue behind a stuck peer;
- waits poll the work (`is_completed`) from the link's thread until its
  deadline; a chunk is complete on the device when the wait returns;
- `close()` aborts the NCCL group (idempotent), so a dropped link leaks no
  communicator; the link's thread that last used the data group calls it.

A link's threads hold the pair (`hold`, `running`): the last one to return
closes what is left of it (the socket transport's control connection, its
native threads and sockets with it), so a link that ended leaves nothing
open, whatever ended it.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from engine.disagg.link.socket_transport import RECV, SEND, SocketGroup
from engine.disagg.link.wire import CTL, DATA, ProtocolError
from resources.device_io import compute_stream, on_device

#: how long a polling wait sleeps between looks at a work, at first and at most (seconds)
POLL_FIRST, POLL_MOST = 0.0002, 0.005


class LinkError(RuntimeError):
    """The link failed; `cause` is one of CAUSES."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


#: why a transfer failed (the `cause` label of the failure counter)
CAUSES = ("peer_closed", "timeout", "transport", "protocol", "prefill_failed", "budget", "no_link", "shutdown",
          "link_down", "auth", "incompatible")


def classify(exc: BaseException) -> LinkError:
    """A transport exception as a LinkError with its cause."""
    if isinstance(exc, LinkError):
        return exc
    if isinstance(exc, ProtocolError):
        return LinkError("protocol", str(exc))
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "imeout" in text:  # incl. "Application timeout caused pair closure"
        cause = "timeout"
    elif "closed" in text or "reset" in text or "closure" in text or "Broken pipe" in text:
        cause = "peer_closed"
    else:
        cause = "transport"
    return LinkError(cause, text.splitlines()[0][:300] if text else type(exc).__name__)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _gloo_device(host: str) -> dist.ProcessGroupGloo.Device:
    if host in ("0.0.0.0", "::", ""):
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=host)


class _PeerGroup(Protocol):
    """The point-to-point half of a c10d backend that a pair uses."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...


def poll_wait(work: Any, timeout: float, *, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait for `work` by polling `is_completed()` from this thread until `timeout`
    (LinkError "timeout"); no stream is made to wait. A work that failed raises
    its error here, classified."""
    deadline = clock() + timeout
    pause = POLL_FIRST
    try:
        while not work.is_completed():
            if clock() >= deadline:
                raise LinkError("timeout", f"Timed out: a transfer was not done within {timeout:g} s")
            sleep(pause)
            pause = min(pause * 2, POLL_MOST)
        error = work.exception() if hasattr(work, "exception") else None
    except LinkError:
        raise
    except Exception as exc:  # noqa: BLE001 - an aborted or failed communicator
        raise classify(exc) from exc
    if error is not None:
        raise classify(error)


def _nccl_group(store: dist.Store, rank: int, timeout: float) -> Any:
    # NOTE: abort the communicator on a timeout instead of tearing the process down
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _delta(timeout)
    return dist.ProcessGroupNCCL(store, rank, 2, options)


class Pair:
    """The two groups of one link, control and chunks (built by both sides at once; blocks until both have)."""

    def __init__(self, store: dist.Store, prefix: str, *, rank: int, host: str, backend: str, device: torch.device,
                 timeout: float, nccl_group: Callable[[dist.Store, int, float], Any] = _nccl_group,
                 transport: str = "gloo") -> None:
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.nccl = backend == "nccl"
        #: what carries the chunks: "nccl", "gloo" or "socket" (`engine.disagg.link.socket_transport`; the
        #: control messages too, on a connection of their own)
        self.transport = "nccl" if self.nccl else transport
        self._sockets: list[SocketGroup] = []
        self._keep = store  # the store must outlive the groups
        self._closed = False
        self._aborted = False  # see `abort`
        self._close_lock = threading.Lock()
        self._users = 0  # link threads using the pair (`hold`, `leave`)
        #: the NCCL path's send and receive streams (None: posted on the caller's stream)
        self.send_stream: Any = None
        self.recv_stream: Any = None
        # torch's stubs name only the public Options; Gloo's constructor takes the pybind _Options
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = _delta(timeout)
        options._devices = [_gloo_device(host)]
        # NOTE: cast, as torch's stubs leave send/recv off Backend though every backend has them
        try:
            if self.transport == "socket":  # NOTE: control and chunks on connections of their own, as over gloo
                for what in ("ctl", "data"):
                    self._sockets.append(SocketGroup.connect(store, prefix + f"socket-{what}/", rank=rank, host=host,
                                                             timeout=timeout))
                self.ctl, self.data = (cast(_PeerGroup, group) for group in self._sockets)
            else:
                self.ctl = cast(_PeerGroup, dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo/", store), rank, 2,
                                                                  options))
            if self.nccl:
                self.data = cast(_PeerGroup, nccl_group(dist.PrefixStore(prefix + "nccl/", store), rank, timeout))
            elif self.transport != "socket":  # NOTE: a socket of its own (same gloo device): control never queues behind a chunk
                self.data = cast(_PeerGroup, dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo-data/", store),
                                                                   rank, 2, options))
        except Exception as exc:  # noqa: BLE001 - rendezvous failures are link failures
            for group in self._sockets:
                group.close()
            raise classify(exc) from exc
        #: chunks travel in host memory (gloo) or device memory (nccl)
        self.data_device = device if self.nccl else torch.device("cpu")
        if self.nccl:
            if device.type == "cuda":
                self.send_stream, self.recv_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
            try:
                self._warm_up(timeout)
            except BaseException:
                self.close()
                raise

    def _warm_up(self, timeout: float) -> None:
        """One transfer on the data group now, so its communicator is connected before any job."""
        with on_device(self.device):
            probe = torch.zeros(1, dtype=torch.uint8, device=self.data_device)
            work = self.post_send_data(probe) if self.rank == 0 else self.post_recv_data(probe)
            self.wait(work, timeout)

    # ------------------------------------------------------------ control
    def send_ctl(self, tensor: torch.Tensor, timeout: float) -> None:
        self._wait(self._post(self.ctl.send, tensor, self._out_tag), timeout)

    def recv_ctl(self, tensor: torch.Tensor, timeout: float) -> None:
        self._wait(self._post(self.ctl.recv, tensor, self._in_tag), timeout)

    def post_send_ctl(self, tensor: torch.Tensor) -> dist.Work:
        """Post a control message without waiting (`wait_ctl`): it travels in order with the others."""
        return self._post(self.ctl.send, tensor, self._out_tag)

    def post_recv_ctl(self, tensor: torch.Tensor) -> dist.Work:
        """Post the receive of the next control message (`wait_ctl`), e.g. before waiting for a chunk, so
        the peer's next header lands without a round trip."""
        return self._post(self.ctl.recv, tensor, self._in_tag)

    def wait_ctl(self, work: dist.Work, timeout: float) -> None:
        """Wait for a control message posted by `post_send_ctl` / `post_recv_ctl` (gloo's own wait)."""
        self._wait(work, timeout)

    # -------------------------------------------------------------- chunks
    def post_send_data(self, tensor: torch.Tensor) -> dist.Work:
        with self._on(self.send_stream, after_compute=True):
            return self._post(self.data.send, tensor, DATA)

    def post_recv_data(self, tensor: torch.Tensor, *, into_kv: bool = False) -> dist.Work:
        """`into_kv`: the tensor is a view of KV pages, so on a device the receive first waits for the
        compute stream (work queued there may still read the pages' previous contents)."""
        with self._on(self.recv_stream, after_compute=into_kv):
            return self._post(self.data.recv, tensor, DATA)

    def post_each(self, works: list[dist.Work], tensors: list[torch.Tensor], *, send: bool, ctl: bool = False,
                  into_kv: bool = False) -> None:
        """Post a send (`send`) or a receive of each tensor, in order, on the control or the data group
        (`ctl`; `into_kv` as in `post_recv_data`), appending each work to `works` as it is posted (the
        caller drains them if a later one fails); over the socket transport all in one call (one lock
        and at most one wake-up of the socket's thread)."""
        group = self._sockets[0 if ctl else 1] if self._sockets else None
        if group is None or not tensors:
            for tensor in tensors:
                if ctl:
                    works.append(self.post_send_ctl(tensor) if send else self.post_recv_ctl(tensor))
                else:
                    works.append(self.post_send_data(tensor) if send else self.post_recv_data(tensor, into_kv=into_kv))
            return
        try:
            works.extend(cast(list[dist.Work], group.post_many(SEND if send else RECV, tensors)))
        except Exception as exc:  # noqa: BLE001 - posting on a closed pair raises at once
            raise classify(exc) from exc

    def wait(self, work: dist.Work, timeout: float) -> None:
        """Wait for a chunk's work: NCCL by polling from this thread (no stream waits), gloo by its own wait."""
        if self.nccl:
            poll_wait(work, timeout)
        else:
            self._wait(work, timeout)

    def wait_all(self, works: list[dist.Work], timeout: float, *, ctl: int = 0) -> None:
        """Wait for the works of one chunk's messages, all within `timeout` from now; the first `ctl` of
        them are control messages (gloo's wait even with NCCL chunks). Over gloo only the last of each
        group is waited for (see the note); with NCCL chunks, each."""
        deadline = time.monotonic() + timeout
        if not self.nccl:
            # NOTE: a gloo group's messages to one peer complete in the order they were posted (one socket,
            # written and read in order), and a failure fails every later one: once the last of each group
            # has completed, all of them have, so only those two are waited for (a wait costs a call into
            # c10d and its lock even when its work is done)
            for i in sorted({ctl - 1, len(works) - 1} - {-1}, reverse=True):
                self._wait(works[i], deadline - time.monotonic())
            return
        # NOTE: the last first: a pair's messages complete in the order they were posted, so the others are
        # done by then and their waits return at once (one wake-up of this thread per chunk, not one per
        # message). Each work is waited for once: a second wait on a gloo work waits for its timeout.
        last = len(works) - 1
        for i in [last, *range(last)] if works else []:
            if i < ctl:
                self._wait(works[i], deadline - time.monotonic())
            else:
                self.wait(works[i], deadline - time.monotonic())

    def drain(self, works: list[dist.Work], timeout: float) -> None:
        """After a failure: wait (within `timeout` from now) until none of `works` can touch its tensor any
        more. A wait that fails or times out aborts the pair (`abort`); once it is aborted nothing reads or
        writes any posted tensor, so the rest need no wait."""
        deadline = time.monotonic() + timeout
        for work in works:
            if self._aborted:
                return
            try:
                self.wait(work, deadline - time.monotonic())
            except Exception:  # noqa: BLE001 - failed or timed out: the pair is aborted
                self.abort()

    def abort(self) -> None:
        """End the pair's connections now (the link is over: a chunk's wait failed or timed out), so no
        send or receive already posted reads or writes its tensor afterwards: gloo's pairs are closed
        (`ProcessGroupGloo.abort`: a posted receive lands nothing, though its wait still runs to its
        timeout), an NCCL communicator aborted. Builds without gloo's abort keep waiting in `drain`."""
        if self.nccl:
            self.close()
            self._aborted = True
            return
        for group in (self.ctl, self.data):
            end = getattr(group, "abort", None)
            if end is None:
                return
            try:
                end()
            except Exception:  # noqa: BLE001 - a group that failed may refuse: its posted works are still waited for
                return
        self._aborted = True

    def close(self) -> None:
        """The data group's last user is done: abort the NCCL group, or close the socket transport's data
        connection (idempotent; nothing to do for gloo, whose groups go with the pair). Its control
        connection closes once every link thread has left (`hold`, `leave`)."""
        if self._sockets:
            self._sockets[1].close()
        with self._close_lock:
            if self._closed or not self.nccl:
                self._closed = True
                return
            self._closed = True
        # NOTE: `abort` where the build has it (older builds: `shutdown`)
        end = getattr(self.data, "abort", None) or getattr(self.data, "shutdown", None)
        if end is not None:
            try:
                end()
            except Exception:  # noqa: BLE001 - a communicator that failed may refuse to abort: it is dropped anyway
                pass

    def hold(self, threads: int) -> None:
        """`threads` link threads use the pair; each calls `leave` as it returns."""
        with self._close_lock:
            self._users += threads

    def running(self, target: Callable[[], None]) -> Callable[[], None]:
        """`target` as one of the pair's link threads: it leaves the pair (`leave`) as it returns."""
        def run() -> None:
            try:
                target()
            finally:
                self.leave()
        return run

    def leave(self) -> None:
        """A link thread is done with the pair: once the last one has left, nothing of it is open (the
        socket transport's connections closed, the NCCL group aborted). A pair no thread held closes at
        once (a link never started)."""
        with self._close_lock:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.close()
            for group in self._sockets:
                group.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _on(self, stream: Any, *, after_compute: bool) -> AbstractContextManager[Any]:
        """Post on the pair's own stream (NCCL on CUDA); a send's stream first waits for the compute
        stream, whose work wrote the chunk."""
        if stream is None:
            return nullcontext()
        if after_compute:
            stream.wait_stream(compute_stream(self.device))
        return torch.cuda.stream(stream)

    # ------------------------------------------------------------ internals
    @property
    def _out_tag(self) -> int:
        return CTL if self.rank == 1 else DATA

    @property
    def _in_tag(self) -> int:
        return DATA if self.rank == 1 else CTL

    def _post(self, op: Callable[[list[torch.Tensor], int, int], dist.Work], tensor: torch.Tensor,
              tag: int) -> dist.Work:
        try:
            return op([tensor], self.peer, tag)
        except Exception as exc:  # noqa: BLE001 - posting on a closed pair raises at once
            raise classify(exc) from exc

    @staticmethod
    def _wait(work: dist.Work, timeout: float) -> None:
        try:
            work.wait(_delta(timeout))
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError for every failure
            raise classify(exc) from exc

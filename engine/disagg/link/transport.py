"""One link's transport: a private two-rank process group per prefill/decode pair.

Rank 0 is the prefill, rank 1 the decode. Control messages (headers, job
frames, keepalives) always go over gloo with CPU tensors; KV chunks go over
the same gloo group (in host memory: on CUDA through pinned staging) or,
with backend "nccl", over a second, NCCL group with device tensors.

Every wait has an explicit timeout. What gloo does on failure (measured in
SCALEOUT.md): a peer that dies with nothing in flight is seen at once
("Connection closed by peer"); one that dies mid-message only at the wait's
timeout; a timeout closes the pair, so nothing sent later lands. `abort()`
does not unblock a waiting receive, so a link is never reused after an
error: it is dropped and a new pair (a new epoch) is built.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.distributed as dist

from engine.disagg.link.wire import CTL, DATA, ProtocolError


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


class Pair:
    """The two process groups of one link (built by both sides at once; blocks until both have)."""

    def __init__(self, store: dist.Store, prefix: str, *, rank: int, host: str, backend: str, device: torch.device,
                 timeout: float) -> None:
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self._keep = store  # the store must outlive the groups
        # torch's stubs name only the public Options; Gloo's constructor takes the pybind _Options
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = _delta(timeout)
        options._devices = [_gloo_device(host)]
        # NOTE: cast, as torch's stubs leave send/recv off Backend though every backend has them
        try:
            self.ctl = cast(_PeerGroup, dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo/", store), rank, 2,
                                                              options))
            self.data = self.ctl
            if backend == "nccl":
                # NOTE: abort the communicator on a timeout instead of tearing the process down
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
                nccl_options = dist.ProcessGroupNCCL.Options()
                nccl_options._timeout = _delta(timeout)
                self.data = cast(_PeerGroup, dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "nccl/", store), rank,
                                                                   2, nccl_options))
        except Exception as exc:  # noqa: BLE001 - rendezvous failures are link failures
            raise classify(exc) from exc
        #: chunks travel in host memory (gloo) or device memory (nccl)
        self.data_device = torch.device("cpu") if self.data is self.ctl else device

    # ------------------------------------------------------------ control
    def send_ctl(self, tensor: torch.Tensor, timeout: float) -> None:
        self._wait(self._post(self.ctl.send, tensor, self._out_tag), timeout)

    def recv_ctl(self, tensor: torch.Tensor, timeout: float) -> None:
        self._wait(self._post(self.ctl.recv, tensor, self._in_tag), timeout)

    # -------------------------------------------------------------- chunks
    def post_send_data(self, tensor: torch.Tensor) -> dist.Work:
        return self._post(self.data.send, tensor, DATA)

    def post_recv_data(self, tensor: torch.Tensor) -> dist.Work:
        return self._post(self.data.recv, tensor, DATA)

    def wait(self, work: dist.Work, timeout: float) -> None:
        self._wait(work, timeout)

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

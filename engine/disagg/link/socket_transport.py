"""The link's socket transport: a pair's messages over TCP connections driven by native threads.

A gloo send or receive is a call into torch that releases the GIL and has to
take it back when it returns, and a link posts one message per layer, K or V
and page run: on a busy process (its event loop running Python) each post
waited for the GIL, and a job's data left late (docs/benchmarks.md, stop 35).
Here a pair is two connections, control and chunks, as over gloo (a control
message never queues behind a chunk), each with a sending and a receiving
thread in native code (`native/socket_channel.cpp`, built like the model's
kernels by `engine.model.native_build`). Posting queues buffers for them in
a call that keeps the GIL (a chunk's messages in one call: `post_many`); the
threads send and receive without it; only a wait gives the GIL up, and a
waiter is woken only once what it waits for is done.

`SocketGroup` has what a pair uses of a gloo group (`send`, `recv`, works
with `wait` / `is_completed` / `exception`, `abort`), with gloo's semantics
where the link relies on them (`engine.disagg.link.transport`): a pair's
messages complete in the order they were posted; a failure fails every
later one; a wait that times out closes the connection (nothing posted
lands afterwards); `abort` returns once no posted buffer is read or written
any more (stronger than gloo's, whose posted receives keep waiting). Every
message carries its size, so a receive that does not expect it fails
("protocol") instead of landing the wrong bytes.

Connecting (`SocketGroup.connect`, within the pair's connect timeout): the
prefill (rank 0) listens on the link's host, port 0, and writes its address
and a random token under the pair's private prefix in the bootstrap store
(a prefix derived from the secret); the decode dials it and sends the token
first; the prefill accepts only a connection that presents it.
"""

from __future__ import annotations

import ctypes
import datetime
import hmac
import json
import secrets
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.disagg.link.wire import ProtocolError
from engine.model.native_build import FLAGS, KernelBuild

#: the library (built on first use; None where it cannot be: the link uses gloo then)
BUILD = KernelBuild(sources=Path(__file__).with_name("native"), name="kvlife_link",
                    flags=tuple(f for f in FLAGS if f != "-fopenmp-simd"),
                    fallback="links carry their chunks over gloo (LinkSettings.transport)")
SEND, RECV = 0, 1
_TOKEN_BYTES = 32
_VP, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Library:
    """The channel functions: posting and looking keep the GIL (`PyDLL`: a queue push, no system
    call); waiting, aborting and closing release it (`CDLL`)."""

    def __init__(self, path: str) -> None:
        holding, releasing = ctypes.PyDLL(path), ctypes.CDLL(path)
        self.open = releasing.kvlife_channel_open
        self.open.argtypes, self.open.restype = [ctypes.c_int], _VP
        self.post = holding.kvlife_channel_post
        self.post.argtypes = [_VP, ctypes.c_int, ctypes.POINTER(_VP), ctypes.POINTER(_I64), _I64]
        self.post.restype = _I64
        self.look = holding.kvlife_channel_wait
        self.wait = releasing.kvlife_channel_wait
        for fn in (self.look, self.wait):
            fn.argtypes, fn.restype = [_VP, ctypes.c_int, _I64, ctypes.c_double], ctypes.c_int
        self.error = holding.kvlife_channel_error
        self.error.argtypes, self.error.restype = [_VP, ctypes.c_char_p, _I64], None
        self.abort = releasing.kvlife_channel_abort
        self.abort.argtypes, self.abort.restype = [_VP, ctypes.c_char_p], None
        self.close = releasing.kvlife_channel_close
        self.destroy = releasing.kvlife_channel_destroy
        for fn in (self.close, self.destroy):
            fn.argtypes, fn.restype = [_VP], None


_library: _Library | None = None
_library_lock = threading.Lock()


def library() -> _Library | None:
    """The loaded channel library, or None where it cannot be built (`BUILD.problem` says why)."""
    global _library
    with _library_lock:
        if _library is None:
            if BUILD.load() is not None:
                _library = _Library(str(BUILD.path))
        return _library


def available() -> bool:
    return library() is not None


def offered(backend: str, setting: str) -> str:
    """The transport this side offers its peers (`LinkSettings.transport`): "socket" with backend gloo
    and setting "auto" where the library builds, else "gloo"."""
    return "socket" if backend == "gloo" and setting == "auto" and available() else "gloo"


class SocketWork:
    """One posted message (what the link uses of a `dist.Work`)."""

    def __init__(self, group: SocketGroup, direction: int, seq: int, tensor: torch.Tensor) -> None:
        self._group, self._direction, self._seq = group, direction, seq
        self._tensor: torch.Tensor | None = tensor  # kept alive until the message is done

    def is_completed(self) -> bool:
        """Done or failed (as a gloo work: `exception` says which)."""
        return self._group._status(self._direction, self._seq, 0.0) != 1

    def exception(self) -> RuntimeError | None:
        if self._group._status(self._direction, self._seq, 0.0) == 2:
            return self._group.failure()
        return None

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Wait until the message is done; RuntimeError if it failed or (closing the connection, as
        gloo does) if it is not done within `timeout` (None: the group's, as a gloo group's default)."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        seconds = max(self._group.timeout if seconds is None else seconds, 1e-6)
        status = self._group._status(self._direction, self._seq, seconds)
        if status == 1:
            self._group.abort(f"Timed out: a message was not done within {seconds:g} s")
            raise RuntimeError(f"Timed out waiting {seconds:g} s for a message on the socket transport")
        if status == 2:
            raise self._group.failure()
        self._tensor = None
        return True


class SocketGroup:
    """One of a pair's two groups (control or chunks) over one connected socket (module docstring)."""

    def __init__(self, sock: socket.socket, lib: _Library, *, timeout: float = 30.0) -> None:
        #: a wait's bound when it names none (the pair's timeout, as a gloo group's `_timeout`)
        self.timeout = timeout
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lib = lib
        handle = lib.open(sock.detach())
        if not handle:
            raise RuntimeError("the socket transport could not start its threads")
        self._handle: int | None = handle

    # ------------------------------------------------------------ connect
    @classmethod
    def connect(cls, store: dist.Store, prefix: str, *, rank: int, host: str, timeout: float) -> SocketGroup:
        """Both sides of a pair at once (module docstring); RuntimeError if it is not up within `timeout`."""
        lib = library()
        if lib is None:
            raise RuntimeError(f"the socket transport is unavailable: {BUILD.problem}")
        key = prefix + "address"
        if rank == 0:
            return cls(_accept(store, key, host, timeout), lib, timeout=timeout)
        store.wait([key], datetime.timedelta(seconds=max(timeout, 0.001)))
        where = json.loads(store.get(key))
        sock = socket.create_connection((where["host"], int(where["port"])), timeout=timeout)
        try:
            sock.sendall(bytes.fromhex(where["token"]))
            return cls(sock, lib, timeout=timeout)
        except BaseException:
            sock.close()
            raise

    # ------------------------------------------------------------ messages
    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> SocketWork:
        return self.post_many(SEND, tensors)[0]

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> SocketWork:
        return self.post_many(RECV, tensors)[0]

    def post_many(self, direction: int, tensors: list[torch.Tensor]) -> list[SocketWork]:
        """Queue one message per tensor (contiguous, in host memory), in order, in one call: their works."""
        for tensor in tensors:
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("the socket transport moves contiguous host tensors only")
        n = len(tensors)
        pointers = (_VP * n)(*(t.data_ptr() for t in tensors))
        sizes = (_I64 * n)(*(t.numel() * t.element_size() for t in tensors))
        handle = self._handle
        first = -1 if handle is None else self._lib.post(handle, direction, pointers, sizes, n)
        if first < 0:
            raise RuntimeError(self.error() or "the socket transport is closed")
        return [SocketWork(self, direction, first + i, t) for i, t in enumerate(tensors)]

    def _status(self, direction: int, seq: int, timeout: float) -> int:
        handle = self._handle
        if handle is None:
            return 2
        if timeout <= 0:
            return int(self._lib.look(handle, direction, seq, 0.0))
        return int(self._lib.wait(handle, direction, seq, timeout))

    def error(self) -> str:
        handle = self._handle
        if handle is None:
            return "the socket transport is closed"
        out = ctypes.create_string_buffer(512)
        self._lib.error(handle, out, len(out))
        return out.value.decode(errors="replace") or "the socket transport failed"

    def failure(self) -> RuntimeError:
        """Why the connection failed, as gloo's errors read (`engine.disagg.link.transport.classify`), or
        a ProtocolError when a message was not what the receive expected."""
        error = self.error()
        return ProtocolError(error) if error.startswith("protocol:") else RuntimeError(error)

    # ----------------------------------------------------------------- end
    def abort(self, reason: str = "the pair was aborted") -> None:
        """Fail every message not done and close the connection; returns once nothing posted is read or
        written any more."""
        handle = self._handle
        if handle is not None:
            self._lib.abort(handle, reason.encode())

    def close(self) -> None:
        """Abort, stop the threads and close the socket (idempotent)."""
        handle = self._handle
        if handle is not None:
            self._lib.close(handle)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            self._lib.destroy(handle)


def _accept(store: dist.Store, key: str, host: str, timeout: float) -> socket.socket:
    """Listen on `host`, port 0, publish the address and a token, accept the connection that presents it."""
    wildcard = host in ("0.0.0.0", "::", "")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    token = secrets.token_bytes(_TOKEN_BYTES)
    deadline = time.monotonic() + timeout
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind(("" if wildcard else host, 0))
        listener.listen(4)
        advertised = socket.gethostbyname(socket.gethostname()) if wildcard else host
        store.set(key, json.dumps({"host": advertised, "port": listener.getsockname()[1], "token": token.hex()}))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"Timed out: the decode did not connect the socket transport within {timeout:g} s")
            listener.settimeout(left)
            sock, _ = listener.accept()
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                presented = _read_exactly(sock, _TOKEN_BYTES)
            except OSError:
                sock.close()
                continue
            if hmac.compare_digest(presented, token):
                return sock
            sock.close()  # NOTE: not the peer: keep listening for it until the deadline


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed before presenting its token")
        data += part
    return data

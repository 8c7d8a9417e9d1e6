"""The socket transport (engine.disagg.link.socket_transport) on its own: two real groups over a
loopback TCP connection, built by `SocketGroup.connect` through a real TCPStore, and the
transport's negotiation (both sides must offer it)."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engine.disagg.link import socket_transport
from engine.disagg.link.socket_transport import SocketGroup
from engine.disagg.link.transport import classify
from engine.disagg.link.wire import KVLayout, compatibility_record, record_mismatch, transport_of


def test_the_library_builds():
    """The sockets' native library builds here (as the model's kernels do: a C++ compiler is part of the
    test machine); where it cannot, a link falls back to gloo (`test_what_a_side_offers`)."""
    assert socket_transport.available(), socket_transport.BUILD.problem
    assert socket_transport.BUILD.path is not None and socket_transport.BUILD.path.name.startswith("kvlife_link-")


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)


def _client(store: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))


def _connect(store: dist.TCPStore, timeout: float = 5.0) -> tuple[SocketGroup, SocketGroup]:
    groups: dict[int, SocketGroup] = {}
    errors: list[BaseException] = []

    def side(rank: int) -> None:
        try:
            groups[rank] = SocketGroup.connect(_client(store), "t/", rank=rank, host="127.0.0.1", timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=side, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert not errors, errors
    return groups[0], groups[1]


@pytest.fixture
def groups():
    sender, receiver = _connect(_store())
    yield sender, receiver
    sender.close()
    receiver.close()


def test_messages_land_in_order_bit_exact(groups):
    sender, receiver = groups
    sources = [torch.randn(1000 + 37 * i) for i in range(12)]
    targets = [torch.full_like(s, float("nan")) for s in sources]
    # NOTE: receives posted after the sends: a stream socket holds the bytes until they are
    works = [sender.send([s], 1, 1) for s in sources]
    received = [receiver.recv([t], 0, 1) for t in targets]
    assert received[-1].wait(datetime.timedelta(seconds=5))
    assert all(w.is_completed() and w.exception() is None for w in received)  # in order: the last done, all are
    assert works[-1].wait(5.0)
    for source, target in zip(sources, targets):
        assert torch.equal(source, target)


def test_a_size_the_receiver_did_not_expect_fails_both_sides(groups):
    sender, receiver = groups
    target = torch.zeros(64)
    work = receiver.recv([target], 0, 1)
    sender.send([torch.ones(65)], 1, 1)
    with pytest.raises(RuntimeError, match="260 bytes where 256") as raised:
        work.wait(5.0)
    assert classify(raised.value).cause == "protocol"
    assert torch.count_nonzero(target) == 0, "nothing of the wrong message landed"
    with pytest.raises(RuntimeError):  # the channel failed: nothing more is posted
        receiver.recv([target], 0, 1)
    with pytest.raises(RuntimeError):  # the receiver shut the socket down: the sender's messages fail too
        for _ in range(200):
            sender.send([torch.ones(1 << 14)], 1, 1).wait(5.0)


def test_a_peer_that_closes_is_peer_closed(groups):
    sender, receiver = groups
    work = receiver.recv([torch.zeros(1 << 16)], 0, 1)
    sender.close()
    with pytest.raises(RuntimeError) as raised:
        work.wait(5.0)
    assert classify(raised.value).cause == "peer_closed"


def test_a_timed_out_wait_closes_the_connection_and_nothing_lands_after(groups):
    sender, receiver = groups
    target = torch.zeros(1 << 12)
    work = receiver.recv([target], 0, 1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out") as raised:
        work.wait(0.2)
    assert time.monotonic() - started >= 0.15, "the wait ran to its timeout, not failing at once"
    assert classify(raised.value).cause == "timeout"
    assert work.is_completed() and work.exception() is not None
    try:  # the peer sends it late: it must not land
        sender.send([torch.ones(1 << 12)], 1, 1).wait(1.0)
    except RuntimeError:
        pass
    time.sleep(0.1)
    assert torch.count_nonzero(target) == 0
    with pytest.raises(RuntimeError):
        receiver.recv([target], 0, 1)


def test_a_wait_that_names_no_bound_has_the_groups(groups):
    """As a gloo work's: a wait without a timeout is bounded by the pair's (the connect timeout)."""
    _, receiver = groups
    assert receiver.timeout == 5.0  # the pair's, from `connect`
    receiver.timeout = 0.2
    with pytest.raises(RuntimeError, match="Timed out"):
        receiver.recv([torch.zeros(8)], 0, 1).wait()


def test_abort_ends_a_posted_receive_at_once(groups):
    _, receiver = groups
    target = torch.zeros(1 << 20)
    work = receiver.recv([target], 0, 1)
    done = threading.Event()
    failure: list[BaseException] = []

    def waiter() -> None:
        try:
            work.wait(30.0)
        except RuntimeError as exc:
            failure.append(exc)
        done.set()

    threading.Thread(target=waiter).start()
    time.sleep(0.05)
    receiver.abort()
    assert done.wait(5.0), "abort ended the wait (posted for 30 s)"
    assert failure and "aborted" in str(failure[0])


def test_only_contiguous_host_tensors(groups):
    sender, _ = groups
    with pytest.raises(ValueError, match="contiguous host"):
        sender.send([torch.zeros(4, 4).t()], 1, 1)


def test_the_listener_takes_only_the_connection_with_the_token():
    store = _store()
    result: dict[str, object] = {}

    def listen() -> None:
        try:
            result["group"] = SocketGroup.connect(_client(store), "t/", rank=0, host="127.0.0.1", timeout=5.0)
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc

    thread = threading.Thread(target=listen)
    thread.start()
    client = _client(store)
    client.wait(["t/address"], datetime.timedelta(seconds=5))
    import json

    where = json.loads(client.get("t/address"))
    assert where["host"] == "127.0.0.1"
    intruder = socket.create_connection((where["host"], where["port"]), timeout=5)
    intruder.sendall(b"x" * 32)  # the wrong token: dropped, the listener keeps waiting for the peer
    intruder.settimeout(5)
    assert intruder.recv(1) == b"", "the listener closed the intruder"
    intruder.close()
    assert "group" not in result
    peer = SocketGroup.connect(client, "t/", rank=1, host="127.0.0.1", timeout=5.0)
    thread.join(10)
    group = result["group"]
    assert isinstance(group, SocketGroup)
    source, target = torch.arange(10.0), torch.zeros(10)
    work = peer.recv([target], 0, 1)
    group.send([source], 1, 1)
    work.wait(5.0)
    assert torch.equal(source, target)
    group.close()
    peer.close()


def test_no_peer_is_a_timeout():
    with pytest.raises(OSError, match="timed out|Timed out"):  # socket.timeout: the listener's deadline
        SocketGroup.connect(_client(_store()), "t/", rank=0, host="127.0.0.1", timeout=0.3)


# ------------------------------------------------------------ negotiation
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _record(offered: str, backend: str = "gloo") -> dict:
    return compatibility_record(model_identity="m", layout=LAYOUT, page_size=4, backend=backend, transport=offered)


@pytest.mark.parametrize("mine, theirs, agreed", [
    ("socket", "socket", "socket"), ("socket", "gloo", "gloo"), ("gloo", "socket", "gloo"), ("gloo", "gloo", "gloo"),
])
def test_the_socket_transport_only_where_both_offer_it(mine, theirs, agreed):
    assert transport_of(_record(mine), _record(theirs)) == agreed
    assert transport_of(_record(theirs), _record(mine)) == agreed, "both sides settle on the same"
    assert record_mismatch(_record(mine), _record(theirs)) is None, "a different offer is not incompatible"


def test_a_peer_from_before_the_socket_transport_gets_gloo():
    older = _record("socket")
    del older["transport"]
    assert transport_of(_record("socket"), older) == "gloo"
    assert record_mismatch(_record("socket"), older) is None


def test_nccl_links_keep_nccl():
    assert transport_of(_record("gloo", "nccl"), _record("gloo", "nccl")) == "nccl"


def test_what_a_side_offers(monkeypatch):
    assert socket_transport.offered("gloo", "auto") == "socket"
    assert socket_transport.offered("gloo", "gloo") == "gloo"
    assert socket_transport.offered("nccl", "auto") == "gloo"
    monkeypatch.setattr(socket_transport, "library", lambda: None)  # no compiler on this side
    assert socket_transport.offered("gloo", "auto") == "gloo"

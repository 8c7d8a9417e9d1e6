"""The CUDA-only paths, checked on the host with stand-ins for what only a GPU has:
NCCL pairs (eager connect with a warm-up transfer, polling waits that make no
stream wait, the group aborted once on close, by the link thread that used it
last), the destination's side stream (waits for the compute stream, then writes,
then returns only once its event is done), the step's single upload buffer, the
read-back, and exact pinning of the host pool."""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist

import disagg_helpers  # noqa: F401 - GLOO_SOCKET_IFNAME=lo
from engine.disagg.decode.decode_link import DecodeLink
from engine.disagg.decode.destination import SideStream
from engine.disagg.link.transport import LinkError, Pair, poll_wait
from engine.model.step_upload import Sections, StepUpload
from resources.device_io import pack_words, pin_in_place, pinned_empty, read_back, unpack_words


class FakeWork:
    """A c10d work that completes after `polls` looks; `wait` must never be called (it would make a
    stream wait on the transfer)."""

    def __init__(self, polls: int = 0, error: Exception | None = None, raises: Exception | None = None) -> None:
        self.polls, self.error, self.raises = polls, error, raises
        self.looks = 0

    def is_completed(self) -> bool:
        if self.raises is not None:
            raise self.raises
        self.looks += 1
        return self.looks > self.polls

    def exception(self):
        return self.error

    def wait(self, *args):
        raise AssertionError("a polling wait never calls work.wait()")


class FakeNCCL:
    """The data group of an NCCL pair: records sends, receives and aborts; works complete as told."""

    def __init__(self, polls: int = 0) -> None:
        self.ops: list[tuple[str, int, int]] = []
        self.aborts = 0
        self.polls = polls

    def send(self, tensors, peer, tag):
        self.ops.append(("send", peer, tensors[0].numel()))
        return FakeWork(self.polls)

    def recv(self, tensors, peer, tag):
        self.ops.append(("recv", peer, tensors[0].numel()))
        return FakeWork(self.polls)

    def abort(self):
        self.aborts += 1


def _pairs(groups: dict[int, FakeNCCL], timeout: float = 5.0) -> tuple[dict[int, Pair], dict[int, BaseException]]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    pairs: dict[int, Pair] = {}
    errors: dict[int, BaseException] = {}

    def build(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
        try:
            pairs[rank] = Pair(client, "t/", rank=rank, host="127.0.0.1", backend="nccl", device=torch.device("cpu"),
                               timeout=timeout, nccl_group=lambda _store, _rank, _timeout: groups[rank])
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors[rank] = exc

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return pairs, errors


class TestNCCLPair:
    def test_connects_eagerly_with_one_warm_up_transfer(self):
        """Building an NCCL pair runs one transfer, rank 0 to rank 1, before any job."""
        groups = {0: FakeNCCL(), 1: FakeNCCL(polls=3)}
        pairs, errors = _pairs(groups)
        assert not errors
        assert groups[0].ops == [("send", 1, 1)] and groups[1].ops == [("recv", 0, 1)]
        assert pairs[1].data_device == torch.device("cpu") and pairs[1].nccl

    def test_a_warm_up_that_does_not_finish_fails_the_connect_and_aborts(self):
        """A communicator that never connects is a failed connect (timeout) and its group is aborted."""
        groups = {0: FakeNCCL(polls=10**9), 1: FakeNCCL(polls=10**9)}
        pairs, errors = _pairs(groups, timeout=0.3)
        assert not pairs and set(errors) == {0, 1}
        assert all(isinstance(e, LinkError) and e.cause == "timeout" for e in errors.values())
        assert groups[0].aborts == groups[1].aborts == 1

    def test_close_aborts_the_group_once(self):
        """close() aborts the NCCL group; a second close does nothing."""
        groups = {0: FakeNCCL(), 1: FakeNCCL()}
        pairs, _ = _pairs(groups)
        pairs[0].close()
        pairs[0].close()
        assert groups[0].aborts == 1 and pairs[0].closed and groups[1].aborts == 0

    def test_chunk_waits_poll_and_never_make_a_stream_wait(self):
        """A data wait on an NCCL pair polls the work (FakeWork.wait would raise)."""
        groups = {0: FakeNCCL(polls=2), 1: FakeNCCL(polls=2)}
        pairs, _ = _pairs(groups)
        work = pairs[1].post_recv_data(torch.empty(8, dtype=torch.uint8))
        pairs[1].wait(work, 1.0)
        assert work.looks == 3


class TestPollWait:
    def test_times_out_at_its_deadline(self):
        """A work that never completes raises LinkError('timeout') once the deadline passes."""
        now = [0.0]
        with pytest.raises(LinkError) as info:
            poll_wait(FakeWork(polls=10**9), 2.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + 0.5))
        assert info.value.cause == "timeout" and now[0] >= 2.0

    def test_a_failed_work_raises_its_error_classified(self):
        """A work whose communicator failed: the failure surfaces as a LinkError with a cause."""
        with pytest.raises(LinkError) as info:
            poll_wait(FakeWork(raises=RuntimeError("NCCL communicator was aborted: connection closed")), 1.0)
        assert info.value.cause == "peer_closed"
        with pytest.raises(LinkError):
            poll_wait(FakeWork(error=RuntimeError("boom")), 1.0)


class TestLinkThreadsClose:
    def test_the_decode_writer_closes_the_pair_as_it_leaves(self):
        """The decode link's writing thread, the last user of the data group, closes the pair on exit."""

        class Pair_:
            closed = 0

            def close(self):
                Pair_.closed += 1

            @staticmethod
            def running(target):  # the real pair's: the thread leaves it as it returns
                return target

        link = DecodeLink(peer="p", epoch=1, boot="b", pair=Pair_(), settings=None, layout=None, stats=None,
                          staging=None)
        link._writes.put(None)
        link._write_loop()
        assert Pair_.closed == 1


class TestSideStream:
    def test_waits_for_compute_then_writes_then_its_event(self):
        """The side stream waits for the compute stream, writes, records an event and waits for it
        before returning: a job (and its fence) can end only after its copies."""
        log: list[str] = []

        class Stream:
            def wait_stream(self, other):
                log.append(f"wait {other}")

        class Event:
            def record(self, stream):
                log.append("record")

            def synchronize(self):
                log.append("synchronize")

        @contextlib.contextmanager
        def enter(stream):
            log.append("enter")
            yield
            log.append("leave")

        side = SideStream(torch.device("cpu"), stream=Stream(), events=Event, enter=enter, after=lambda: "compute")
        side.run(torch.ones(3), torch.device("cpu"), lambda kv: log.append(f"write {int(kv.sum())}"))
        assert log == ["wait compute", "enter", "write 3", "leave", "record", "synchronize"]


class TestStepUpload:
    def test_one_buffer_one_copy_per_step(self):
        """Sections of one host buffer go to the device in one copy; the buffer is reused, grown only when short."""
        upload = StepUpload(torch.device("meta"), capacity=8)
        host_buffer = upload._host
        layout = Sections()
        layout.add("ids", 3)
        layout.add("positions", 3)
        host = upload.start(layout.size)
        layout.write(host, "ids", [1, 2, 3])
        layout.write(host, "positions", [4, 5, 6])
        dev = upload.send(layout.size)
        assert upload.copies == 1 and dev.device.type == "meta" and layout.view(dev, "positions").shape == (3,)
        upload.start(6)
        upload.send(6)
        assert upload.copies == 2 and upload._host is host_buffer
        upload.start(20)
        assert upload.capacity >= 20 and upload._host is not host_buffer

    def test_on_the_host_the_sections_are_the_buffer(self):
        """On CPU nothing is copied: the step reads its sections in place."""
        upload = StepUpload(torch.device("cpu"))
        host = upload.start(4)
        host[:4] = [9, 8, 7, 6]
        assert upload.send(4).tolist() == [9, 8, 7, 6] and upload.copies == 0


class TestReadBack:
    def test_packs_every_dtype_into_one_copy(self):
        """Tokens, bools, floats and routing pack into one int64 tensor (one copy) and unpack to
        their shapes, dtypes and exact values."""
        parts = [torch.tensor([3, 1, 2]), torch.tensor([[True, False]]), torch.tensor([-0.5, 1e-7, -3.3258]),
                 torch.arange(12, dtype=torch.int32).view(2, 3, 2)]
        words = pack_words(parts)
        assert words.dtype == torch.int64 and words.numel() == sum(p.numel() for p in parts)
        for a, b in zip(parts, unpack_words(words.clone(), parts), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    def test_host_tensors_come_back_as_they_are(self):
        """On the host there is nothing to copy."""
        t = torch.tensor([1, 2])
        assert read_back([t])[0] is t


class FakeCudart:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


class TestExactPinning:
    def test_pins_exactly_the_tensor_and_unpins_it_when_freed(self):
        """A host pool of 3 MiB + 16 bytes is registered as exactly that many bytes (no power-of-two
        rounding) and unregistered when the tensor goes."""
        cudart = FakeCudart()
        t = torch.zeros((3 << 20) + 16, dtype=torch.uint8)
        ptr = t.data_ptr()
        pin_in_place(t, register=cudart)
        assert cudart.registered == {ptr: (3 << 20) + 16}
        ref = weakref.ref(t)
        del t
        assert ref() is None and cudart.unregistered == [ptr]

    def test_pins_nothing_off_cuda(self):
        """pin=False (no CUDA) is an ordinary zeroed tensor."""
        t = pinned_empty((4, 2), torch.float32, pin=False)
        assert not t.is_pinned() and t.abs().sum() == 0 and t.shape == (4, 2)


def test_upload_is_the_array_on_the_host():
    """upload on CPU returns the array's values as a tensor; on meta a meta tensor of the same shape."""
    from resources.device_io import upload

    values = np.arange(5, dtype=np.int64)
    assert upload(values, torch.device("cpu")).tolist() == [0, 1, 2, 3, 4]
    assert upload(values, torch.device("meta")).shape == (5,)

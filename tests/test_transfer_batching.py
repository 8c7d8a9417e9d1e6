"""Protocol 4: the jobs the decode's sending thread finds queued together travel in one JOB message (their
tags and frame sizes in its header), so a burst of jobs costs one round trip between the two sides, not
one per job; each still reaches the prefill, in order, and lands. A real gloo pair and the scripted
prefill of test_disagg_link."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.disagg.link.wire import JOB, MAX_JOBS, OK, ProtocolError, job_index, jobs_header
from test_disagg_link import _kv, _submit, _wait, transport, link_pair  # noqa: F401 - the fixtures


class _HeldSends:
    """The decode's pair, whose first control send waits until `release` is set."""

    def __init__(self, pair) -> None:
        self._pair = pair
        self.entered, self.release = threading.Event(), threading.Event()

    def post_send_ctl(self, tensor):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10)
        return self._pair.post_send_ctl(tensor)

    def __getattr__(self, name):
        return getattr(self._pair, name)


def test_jobs_queued_together_travel_in_one_message(link_pair):
    """While the first JOB message is held, four more jobs queue: they leave as one message of four, reach
    the prefill in order with their own tags and specs, and all land (each in its own pages)."""
    link, prefill, buffers, _, staging = link_pair
    held = _HeldSends(link.pair)
    link.pair = held
    jobs = [_submit(link, buffers, "r0", start=0)]
    assert held.entered.wait(10)
    jobs += [_submit(link, buffers, f"r{i}", start=3 * i) for i in range(1, 5)]
    held.release.set()
    received = [prefill.recv_frame() for _ in jobs]
    assert prefill.batches == [1, 4]
    assert [(op, tag, spec.request_id) for op, tag, spec in received] == [(JOB, lj.tag, f"r{i}")
                                                                          for i, lj in enumerate(jobs)]
    for lj in jobs:
        prefill.answer(lj.tag, OK, 5)
        for index, kv in enumerate(_kv(lj.plan)):
            prefill.chunk(lj, index, kv)
        _wait(lj.job.fence.done)
        assert lj.job.outcome[0] == "ok"
    assert staging.held == 0


class TestJobIndex:
    def test_round_trip(self):
        """A header made for some frames announces exactly their tags and sizes."""
        frames = [(3, torch.zeros(10, dtype=torch.uint8)), (4, torch.zeros(7, dtype=torch.uint8))]
        assert job_index(jobs_header(frames).tolist(), 1 << 20) == [(3, 10), (4, 7)]

    @pytest.mark.parametrize("values, why", [
        ([JOB, 0, 10, 0], "announces 0 jobs"),
        ([JOB, 0, 10, MAX_JOBS + 1], f"announces {MAX_JOBS + 1} jobs"),
        ([JOB, 0, 10, 1, 3, 9], "do not make its 10 bytes"),
        ([JOB, 0, 10, 1, 3, 10], "at most 8"),
    ], ids=["none", "too-many", "sizes", "too-big"])
    def test_a_malformed_header_is_a_protocol_error(self, values, why):
        """A count out of range, sizes that do not add up, or more bytes than the prefill takes: refused,
        saying which."""
        with pytest.raises(ProtocolError, match=why):
            job_index(values + [0] * (32 - len(values)), 8)

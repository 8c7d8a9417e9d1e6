"""The loop's bookkeeping of live requests: submissions, the admission queue,
pending aborts.

A `Submission` is one `Engine.generate` call: its user-facing id, its `n`
requests (one per sequence; sequence i of an n > 1 submission has the id
``f"{request_id}/{i}"``), the output stream they share and one
`OutputBuilder` each. A request's phase is its state, nothing else: the
admission queue only orders the QUEUED ones.

NOTE: aborts are queued by submission *object*, so closing an old stream
can never abort a newer submission that reuses its id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

import attrs

from engine.runtime.output_builder import OutputBuilder
from engine.outputs import RequestOutput
from states import FinishReason, Request, RequestState

S = RequestState
#: states of admitted requests that have not finished
RUNNING_STATES = frozenset({S.TRANSFERRING, S.PREFILLING, S.PREBUILT, S.STAGING, S.DECODING})


class OutputSink(Protocol):
    """Where a submission's outputs go (`engine.stream.OutputChannel`)."""

    #: the reader wants final outputs only: the loop builds no chunk for it
    final_only: bool

    def send(self, item: RequestOutput | BaseException) -> bool:
        """False once the receiver has left."""
        ...

    def close(self) -> None: ...


@attrs.define(eq=False)
class Submission:
    request_id: str
    requests: list[Request]
    send: OutputSink | None  # the client's stream (None once closed, or for a request nobody streams)
    builders: dict[Request, OutputBuilder]
    #: requests not yet finished; the stream closes when it reaches 0
    open: int = 0
    #: n > 1: the first sequence's prompt KV is in the prefix cache (or it will never be):
    #: the other sequences may be admitted now, and match it
    prompt_ready: bool = False

    def __attrs_post_init__(self) -> None:
        self.open = len(self.requests)
        self.prompt_ready = len(self.requests) == 1

    @property
    def leader(self) -> Request:
        """The sequence that computes the shared prompt."""
        return self.requests[0]

    def admissible(self, request: Request) -> bool:
        return self.prompt_ready or request is self.leader


class RequestTable:
    def __init__(self) -> None:
        #: every submission with a request not yet RELEASED, by user-facing id
        self.submissions: dict[str, Submission] = {}
        #: every request not yet RELEASED -> its submission
        self.owner: dict[Request, Submission] = {}
        #: QUEUED requests in admission order (retracted ones go to the head)
        self.waiting: deque[Request] = deque()
        #: requests handed over by `submit` whose start has not succeeded yet
        self.unstarted: deque[Request] = deque()
        #: (submission, reason) to finish; appended from any thread
        self.aborts: deque[tuple[Submission, FinishReason]] = deque()

    # ------------------------------------------------------------- writes
    def add(self, submission: Submission, *, start: bool = True) -> None:
        """Take `submission` in; `start=False` keeps its requests out of `unstarted` (held)."""
        self.submissions[submission.request_id] = submission
        for request in submission.requests:
            self.owner[request] = submission
            if start:
                self.unstarted.append(request)

    def forget_unstarted(self, request: Request) -> None:
        """`request` was finished before its start succeeded."""
        try:
            self.unstarted.remove(request)
        except ValueError:
            pass

    def forget(self, request: Request) -> None:
        """`request` reached RELEASED."""
        submission = self.owner.pop(request, None)
        if submission is None:
            return
        if not any(self.owner.get(r) is submission for r in submission.requests):
            if self.submissions.get(submission.request_id) is submission:
                del self.submissions[submission.request_id]

    # ------------------------------------------------------------- reads
    def __len__(self) -> int:
        return len(self.owner)

    def requests(self) -> Iterator[Request]:
        return iter(list(self.owner))

    def in_state(self, *states: RequestState) -> list[Request]:
        return [r for r in self.owner if r.state in states]

    def running(self) -> list[Request]:
        return [r for r in self.owner if r.state in RUNNING_STATES and r.history]

    def finished(self) -> list[Request]:
        return [r for r in self.owner if r.state is S.FINISHED]


def close_stream(submission: Submission) -> None:
    send, submission.send = submission.send, None
    if send is not None:
        send.close()

"""Sending outputs: a request's chunks and its final output, to its submission's stream.

The step applier sends a chunk per accepted token; the gateway sends the
final output when a request finishes, and closes the stream after the last
sequence of its submission. A stream whose client has left (the send
refuses) is closed, and what its submission asked for is aborted at the
loop's next iteration (queued, never done inside a send).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.outputs import RequestOutput
from engine.runtime.table import RequestTable, Submission, close_stream
from states import FinishReason, Request, TokenLogprob


class OutputSender:
    def __init__(self, table: RequestTable) -> None:
        self.table = table

    def chunk(self, request: Request, tokens: Sequence[int], text: str,
              logprobs: tuple[TokenLogprob, ...] | None) -> None:
        """A chunk of a running request (one or more accepted tokens, their new text)."""
        submission = self.table.owner.get(request)
        if submission is None:
            return
        send = submission.send
        if send is None or send.final_only:  # NOTE: nobody reads chunks: none is built
            return
        builder = submission.builders[request]
        self._send(submission, builder.output(list(tokens), text, final=False, logprobs=logprobs))

    def final(self, request: Request, *, tokens: Sequence[int] = (), text: str = "", flush_text: bool = True,
              logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        """The final output of a request that just finished; closes the stream after its
        submission's last sequence. `flush_text=False` when a stop string ended it: the
        text held back is the stop string's start, not output."""
        submission = self.table.owner.get(request)
        if submission is None:
            return
        builder = submission.builders[request]
        if flush_text:
            text += builder.flush()
        self._send(submission, builder.output(list(tokens), text, final=True, logprobs=logprobs))
        submission.open -= 1
        if submission.open <= 0:
            close_stream(submission)

    def _send(self, submission: Submission, output: RequestOutput) -> None:
        send = submission.send
        if send is None:
            return
        if not send.send(output):
            close_stream(submission)  # the client left: abort what it asked for, if anything is left
            if any(not r.is_finished for r in submission.requests):
                self.table.aborts.append((submission, FinishReason.ABORT))

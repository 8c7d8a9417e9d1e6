"""Failed generations as OpenAI clients (and routers) expect failures.

The engine finishes a request that could not be served with `ERROR`,
`TRANSFER_FAILED` (its KV transfer failed, or every prefill peer refused
this decode) or `SHUTDOWN`. OpenAI defines no such finish reasons, and a
200 with empty text is a success to its SDK, whose retries (and a router's,
which retries on 5xx) then never run. So the OpenAI routes answer them as
errors, in OpenAI's error shape (`engine.serve.http_errors.error_body`):

| finish reason | status | type |
|---|---|---|
| `transfer_failed`, `shutdown` | 503, with `Retry-After` | `service_unavailable` |
| `error` (also: the engine's loop died) | 500 | `server_error` |
| `deadline`, before the first token | 408 | `timeout` |

A deadline (the request's own time budget, `deadline` in the body or the
server's `--default-deadline`) that passes after the first token cuts the
answer short: the choice ends with finish_reason `length`, OpenAI's reason
for a truncated answer (`openai_finish_reason`); only a deadline that left
no token is a failure: 408, a client-side status, so a router (which retries
5xx and 429) does not resend it: the budget was the client's own. The openai
SDK does retry a 408 (its default policy), as a new request with a new budget.

- Before the first token (streamed or not): that HTTP status. A stream's
  response starts only with its first token, so a request that fails
  before it gets a real HTTP error, not a 200 stream.
- After the first token, streamed: an error event, ``data: {"error":
  {...}}``, instead of the failed choice's last chunk (the openai SDK raises
  `APIError` on it), then ``[DONE]``.
- Not streamed: the answer is the error, whenever the failure came.

The message says what happened in general terms; the precise reason stays
in ``/generate``'s ``meta_info.error`` (which keeps answering 200 with the
engine's finish reason), the ``request.summary`` log line and the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.serve.http_errors import error_body

_FAILED = {
    "transfer_failed": (503, "the KV transfer from the prefill server failed (or every prefill server refused "
                             "this decode); retry the request"),
    "shutdown": (503, "the server is shutting down; retry the request on another"),
    "error": (500, "the engine failed while serving this request (logged by the server)"),
    "deadline": (408, "the request's deadline passed before its first token"),
}


class GenerationFailed(Exception):
    """A generation finished with a failure; `status` is the HTTP status that says so."""

    def __init__(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason
        self.status, self.message = _FAILED[finish_reason]
        super().__init__(self.message)

    @property
    def retryable(self) -> bool:
        """Worth retrying elsewhere or later (503, sent with Retry-After)."""
        return self.status == 503

    def body(self) -> dict:
        return error_body(self.status, self.message)


def openai_finish_reason(finish_reason: str, *, produced: bool) -> str:
    """The finish reason an OpenAI route answers: a deadline that cut an answer after its
    first token is `length` (truncated); every other reason is the engine's."""
    return "length" if finish_reason == "deadline" and produced else finish_reason


def is_failure(finish_reason: str | None) -> bool:
    return finish_reason in _FAILED


def first_failure(finish_reasons: Iterable[str | None]) -> GenerationFailed | None:
    """The failure among these finish reasons (the first one), or None."""
    return next((GenerationFailed(r) for r in finish_reasons if r is not None and is_failure(r)), None)

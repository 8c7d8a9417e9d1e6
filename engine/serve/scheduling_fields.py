"""Issue 21's request fields over HTTP (docs/http.md); `Engine.generate` validates their values.

Every generation route (`/generate`, `/v1/completions`, `/v1/chat/completions`):

- ``priority``: an integer, lower runs first (vLLM's field and convention; 0).
- ``deadline``: seconds from arrival after which the request finishes with
  ``finish_reason: "deadline"`` (default: `ServerSettings.default_deadline`,
  ``kvlife serve --default-deadline``; none when both are absent).

`/generate` only: ``session_params: {"id": ...}`` (SGLang's field) runs the
request as a turn of an open session (`/open_session`); ``resume_output_ids``
(also on `/v1/completions`) continues a request from the tokens it already
generated elsewhere, the prompt being the original one and the max tokens
what is left of the budget.

`/v1/completions` and `/v1/chat/completions`: ``prompt_logprobs`` (vLLM's
field: the number of alternatives per prompt token, 0 to 20).
"""

from __future__ import annotations

from typing import Any

import attrs

from engine.errors import InvalidRequest

#: the fields each route takes besides its own
COMMON = frozenset({"priority", "deadline"})
GENERATE = COMMON | {"session_params", "resume_output_ids"}
COMPLETIONS = COMMON | {"resume_output_ids", "prompt_logprobs"}
CHAT = COMMON | {"prompt_logprobs"}


@attrs.frozen
class SubmitFields:
    """What the route passes to `Engine.generate` besides the prompt and the sampling parameters
    (`Engine.generate` validates priority, deadline and resume_output_ids, naming the same fields,
    before anything is allocated)."""

    priority: Any = 0
    deadline: Any = None
    session: str | None = None
    resume_output_ids: Any = None

    def kwargs(self, default_deadline: float | None = None) -> dict[str, Any]:
        """The `Engine.generate` keywords that differ from their defaults."""
        deadline = self.deadline if self.deadline is not None else default_deadline
        out: dict[str, Any] = {}
        if self.priority != 0 or isinstance(self.priority, bool):
            out["priority"] = self.priority
        if deadline is not None:
            out["deadline"] = deadline
        if self.session is not None:
            out["session"] = self.session
        if self.resume_output_ids is not None:
            out["resume_output_ids"] = self.resume_output_ids
        return out


def parse_submit_fields(body: dict[str, Any]) -> SubmitFields:
    """The fields above from a body whose keys were already checked; InvalidRequest names the field."""
    session = None
    params = body.get("session_params")
    if params is not None:
        if not isinstance(params, dict):
            raise InvalidRequest("session_params", "a JSON object", params)
        for key in params:
            if key != "id":
                raise InvalidRequest(f"session_params.{key}", "a known field (id)", key)
        session = params.get("id")
        if not (isinstance(session, str) and session):
            raise InvalidRequest("session_params.id", "the id of an open session", session)
    return SubmitFields(0 if body.get("priority") is None else body["priority"], body.get("deadline"), session,
                        body.get("resume_output_ids"))


def engine_field(field: str) -> str:
    """The body's name of a field an engine error names."""
    return {"request_id": "rid", "session": "session_params.id", "SamplingParams.n": "n"}.get(field, field)

"""RequestOutput: what a client receives for each streamed chunk."""

from __future__ import annotations

from typing import Any

import attrs

from states import FinishReason


@attrs.frozen
class RequestOutput:
    """One chunk of a request's stream; the last one has `finished=True`.

    `token_ids` is the whole output so far and `text` its decoding (computed
    on first access, so streaming costs nothing for clients that only want
    ids). On the final output the timings are set, in seconds from arrival:
    `queue_time` to admission, `time_to_first_token`, `completion_time`.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    _tokenizer: Any = attrs.field(default=None, repr=False, eq=False, alias="tokenizer")
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float | None = None
    time_to_first_token: float | None = None
    completion_time: float | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(self.token_ids)

"""RequestOutput: what a client receives for each streamed chunk.

Nothing here grows with the length of the output: `new_token_ids` and
`new_text` are the chunk's own; `token_ids` and `text` are views of the
request's whole output so far, materialised only when read.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from states import FinishReason, TokenLogprob

__all__ = ["RequestOutput", "TokenLogprob"]


@attrs.frozen
class SpeculationStats:
    """A request's speculative decoding (on the final output of an engine that speculates):
    draft tokens verified, those accepted, and the model steps that produced its tokens."""

    draft_tokens: int
    accepted_tokens: int
    steps: int
    output_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over verified drafts (0.0 when none was verified)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per model step that produced any (1.0 without speculation)."""
        return self.output_tokens / self.steps if self.steps else 0.0


@attrs.frozen
class RequestOutput:
    """One chunk of a request's stream; the last one has `finished=True`.

    `new_text` is the text this chunk adds (incremental detokenization: an
    incomplete UTF-8 sequence, or text that may start a stop string, is held
    back until it is decided); `index` says which of the request's `n`
    sequences it belongs to. On the final output the timings are set, in
    seconds from arrival: `queue_time` to admission, `time_to_first_token`,
    `completion_time`; and `speculation` when the engine speculates.
    """

    request_id: str
    new_token_ids: list[int]
    _all_ids: Sequence[int] = attrs.field(repr=False, eq=False, alias="all_ids")
    _num_ids: int = attrs.field(repr=False, alias="num_ids")
    new_text: str = ""
    _text_parts: Sequence[str] = attrs.field(default=(), repr=False, eq=False, alias="text_parts")
    _num_parts: int = attrs.field(default=0, repr=False, alias="num_parts")
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: issue 21: with `SamplingParams.prompt_logprobs`, one entry per prompt token (the first None),
    #: on the request's first output and on its final one
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float | None = None
    time_to_first_token: float | None = None
    completion_time: float | None = None
    error: str | None = None
    #: on the final output of an engine that speculates (`EngineConfig.speculative`), else None
    speculation: SpeculationStats | None = None

    @property
    def token_ids(self) -> list[int]:
        """The whole output so far (the stop string's tokens included, as in vLLM)."""
        return list(self._all_ids[: self._num_ids])

    @property
    def text(self) -> str:
        """The whole text so far (the stop string excluded)."""
        return "".join(self._text_parts[: self._num_parts])

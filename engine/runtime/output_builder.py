"""Per-request output building: incremental detokenization, stop strings,
and the `RequestOutput` of each chunk.

Detokenization is incremental: each token's text is the difference between
decoding a short window of the latest ids with and without it, so nothing is
ever re-decoded from the start. Text that ends in an incomplete UTF-8
sequence (U+FFFD at the end) waits for the next token. Stop strings are
matched on the text across token boundaries: the longest tail that could
still start a stop string is held back until the next token decides it, and
a match cuts the text before the stop string.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from engine.outputs import RequestOutput, SpeculationStats, TokenLogprob
from states import Request, RequestState

#: ids of context decoded before the new ones, so a token's leading space or
#: merged bytes come out as they do in a whole-text decode
_WINDOW = 4
_REPLACEMENT = "\ufffd"
_ADMITTED = (RequestState.PREFILLING, RequestState.TRANSFERRING)


class IncrementalDetokenizer:
    """A tokenizer's own streaming decoder when it has one (`incremental_decoder()`, the
    byte tokenizer's), else the window diff described above."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._read = 0  # ids[:_read] are already turned into text
        make = getattr(tokenizer, "incremental_decoder", None)
        self._stream = make() if make is not None else None

    def add(self, new_ids: Sequence[int]) -> str:
        """The text `new_ids` add (possibly empty while a character is incomplete)."""
        if self._stream is not None:
            text: str = self._stream.add(new_ids)
            return text
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever text is still pending (at the end of the output)."""
        if self._stream is not None:
            text: str = self._stream.flush()
            return text
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        start = max(0, self._read - _WINDOW)
        before = self.tokenizer.decode(self.ids[start : self._read]) if self._read > start else ""
        after = self.tokenizer.decode(self.ids[start:])
        if not final and after.endswith(_REPLACEMENT):
            return ""
        self._read = len(self.ids)
        new: str = after[len(before):] if after.startswith(before) else after
        return new


class StopMatcher:
    """Finds the first stop string in a stream of text pieces."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found). After a match the
        text before the stop string that completed first is returned, the rest dropped."""
        if not self.stops:
            return text, False
        pending = self._held + text
        # NOTE: the stop that completes first wins (ties: the longer), as if fed a character
        # at a time, so the result does not depend on where token boundaries fall
        hits = [(i + len(s), i) for s in self.stops if (i := pending.find(s)) >= 0]
        if hits:
            self._held = ""
            return pending[: min(hits)[1]], True
        keep = self._possible_start(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _possible_start(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


class OutputBuilder:
    """Turns one request's accepted tokens into `RequestOutput` chunks."""

    def __init__(self, request: Request, tokenizer: Any, *, index: int = 0, request_id: str | None = None,
                 speculative: bool = False) -> None:
        self.request = request
        #: the engine speculates: the final output carries `SpeculationStats`
        self.speculative = speculative
        self.index = index
        #: the id the client submitted (sequence i of an n > 1 request runs as "id/i")
        self.request_id = request.request_id if request_id is None else request_id
        params = request.params
        self._detok = IncrementalDetokenizer(tokenizer) if params.detokenize else None
        self._stops = StopMatcher(params.stop)
        self._parts: list[str] = []
        # -- issue 21
        #: the prompt's logprobs as the prefill steps compute them (the first token has none)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if getattr(params, "prompt_logprobs", None) is None else [None])
        self._prompt_logprobs_sent = False
        if request.output_token_ids:  # a resumed request: its text continues the earlier output
            self.add_tokens(request.output_token_ids)

    def add_prompt_logprobs(self, first_position: int, entries: Sequence[TokenLogprob]) -> None:
        """Entries for prompt positions [first_position, ...), in order; positions already
        held (a prompt computed again after a retraction) are skipped."""
        held = self.prompt_logprobs
        if held is None or first_position > len(held):
            return
        held.extend(entries[len(held) - first_position :])

    def add_tokens(self, new_ids: Sequence[int]) -> tuple[str, bool]:
        """The new text the tokens add (held-back text excluded), and whether a stop string ended it."""
        if self._detok is None:
            return "", False
        text, stopped = self._stops.feed(self._detok.add(new_ids))
        if text:
            self._parts.append(text)
        return text, stopped

    def flush(self) -> str:
        """At the end (a finish other than a stop string): the text held back so far."""
        if self._detok is None:
            return ""
        text, stopped = self._stops.feed(self._detok.flush())
        text += "" if stopped else self._stops.flush()
        if text:
            self._parts.append(text)
        return text

    def output(self, new_ids: list[int], new_text: str, *, final: bool,
               logprobs: tuple[TokenLogprob, ...] | None = None) -> RequestOutput:
        request = self.request
        if not final and self.prompt_logprobs is None:  # NOTE: the common chunk, built with no dict in between
            return RequestOutput(request_id=self.request_id, new_token_ids=new_ids, all_ids=request.output_token_ids,
                                 num_ids=len(request.output_token_ids), new_text=new_text, text_parts=self._parts,
                                 num_parts=len(self._parts), index=self.index, logprobs=logprobs)
        common: dict[str, Any] = dict(request_id=self.request_id, new_token_ids=new_ids, all_ids=request.output_token_ids,
                      num_ids=len(request.output_token_ids), new_text=new_text, text_parts=self._parts,
                      num_parts=len(self._parts), index=self.index, logprobs=logprobs)
        if self.prompt_logprobs is not None and (final or not self._prompt_logprobs_sent):
            common["prompt_logprobs"] = tuple(self.prompt_logprobs)  # issue 21: first and final outputs
            self._prompt_logprobs_sent = True
        if not final:
            return RequestOutput(**common)
        now = time.monotonic()
        admitted = next((t for state, t in request.history if state in _ADMITTED), None)
        first = request.first_token_time
        return RequestOutput(
            **common,
            finished=True,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            queue_time=None if admitted is None else admitted - request.arrival_time,
            time_to_first_token=None if first is None else first - request.arrival_time,
            completion_time=now - request.arrival_time,
            error=None if request.error is None else repr(request.error),
            speculation=SpeculationStats(request.num_draft_tokens, request.num_accepted_drafts,
                                         request.num_token_steps, request.num_output_tokens)
            if self.speculative else None,
        )

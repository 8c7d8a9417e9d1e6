"""OpenAI's logprob shapes, from the engine's `TokenLogprob` entries.

    completion = CompletionLogprobs(engine.tokenizer)
    completion(index, entries, new_text)   # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    chat_logprobs(engine.tokenizer, entries)   # {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}

A token is shown as its decoded text (``decode([id])``: a piece of a
multi-byte character is U+FFFD, a special token is ""); chat's ``bytes`` are
the token's own bytes (`Tokenizer.token_bytes`), so the bytes of a message's
tokens, joined, are the message's UTF-8.

Completions (the legacy shape):

- ``top_logprobs`` is one ``{text: logprob}`` per token, from the engine's k
  best alternatives. Tokens whose texts collide (two pieces of different
  characters both shown as U+FFFD; two special tokens shown as "") share one
  key: it holds the sampled token's own logprob when the sampled token has
  that text (so it always equals ``token_logprobs``), else the best of them.
  A dict can then hold fewer than k entries.
- ``text_offset`` is where each token starts in the choice's text, in
  characters: the characters its earlier tokens' bytes decode to (a token
  that completes a character started by the one before it starts where
  that character does). Offsets never decrease and never pass the end of
  the text sent so far (a stop string's tokens start at its end). An echoed
  prompt (issue 21's ``echo``) follows the same rules (`text_offsets`,
  `legacy_top`), and the output's offsets run on from its end (`start`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from engine.outputs import TokenLogprob


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


class CompletionLogprobs:
    """The legacy completions shape for every choice of one answer; offsets run on across its chunks."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}
        self._chars: dict[int, int] = {}  # characters the choice's tokens decoded to so far
        self._sent: dict[int, int] = {}  # characters of the choice's text sent so far

    def start(self, index: int, text: str) -> None:
        """Choice `index`'s text starts with `text` (an echoed prompt): its offsets run on from its end."""
        self._chars[index] = self._sent[index] = len(text)

    def __call__(self, index: int, entries: Sequence[TokenLogprob] | None, new_text: str) -> dict[str, Any] | None:
        """The logprobs of choice `index`'s `entries`, which come with `new_text` of its text."""
        if entries is None:
            return None
        decoder = self._decoders.setdefault(index, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        chars = self._chars.get(index, 0)
        sent = self._sent[index] = self._sent.get(index, 0) + len(new_text)
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(token_text(self.tokenizer, entry.token_id))
            offsets.append(min(chars, sent))
            chars += len(decoder.decode(self.tokenizer.token_bytes(entry.token_id)))
        self._chars[index] = chars
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [legacy_top(self.tokenizer, text, entry) for text, entry in zip(tokens, entries)],
                "text_offset": offsets}


def legacy_top(tokenizer: Any, sampled: str, entry: TokenLogprob) -> dict[str, float]:
    """`entry`'s alternatives as ``{text: logprob}``: a shared text once, with the sampled token's (whose
    text is `sampled`) own logprob if it has that text, else the best of them."""
    top: dict[str, float] = {}
    for token_id, logprob in entry.top:  # best first: a text's first alternative is its best
        top.setdefault(token_text(tokenizer, token_id), logprob)
    if sampled in top:
        top[sampled] = entry.logprob
    return top


def text_offsets(tokenizer: Any, token_ids: Sequence[int], end: int) -> list[int]:
    """Where each token starts in the text they decode to (`end` characters long), by the same rules."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, chars = [], 0
    for token_id in token_ids:
        offsets.append(min(chars, end))
        chars += len(decoder.decode(tokenizer.token_bytes(token_id)))
    return offsets


def _chat_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": token_text(tokenizer, token_id), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id))}


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = [_chat_entry(tokenizer, e.token_id, e.logprob)
               | {"top_logprobs": [_chat_entry(tokenizer, t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}

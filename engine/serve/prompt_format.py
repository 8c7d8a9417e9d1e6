"""Issue 21's answer parts: vLLM's ``prompt_logprobs`` and OpenAI's completions ``echo``.

``prompt_logprobs`` (vLLM's shape): one entry per prompt token, the first
``null``, each other ``{"<token id>": {"logprob", "rank", "decoded_token"}}``
for the prompt token and its best alternatives (rank 1 = most likely). On a
completions choice (``choices[i].prompt_logprobs``) and at the top of a chat
answer (``prompt_logprobs``), as vLLM puts them; streamed, on the first chunk
of each choice.

``echo: true`` (completions): the choice's text starts with the prompt (as
given, or decoded from token ids); with ``logprobs: k`` the legacy logprobs
start with the prompt's tokens, the first with ``null`` logprob and ``null``
top logprobs, and ``text_offset`` runs on from the prompt into the output.
With ``max_tokens: 0`` the answer is the prompt alone (one token is computed
and dropped; usage counts no completion token), as lm-eval's loglikelihood
requests expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.outputs import TokenLogprob
from engine.serve.logprob_format import legacy_top, text_offsets, token_text


def prompt_logprobs_json(tokenizer: Any, entries: Sequence[TokenLogprob | None] | None) -> list[Any] | None:
    if entries is None:
        return None
    out: list[Any] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        alternatives = {str(t): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([t])}
                        for rank, (t, lp) in enumerate(entry.top, start=1)}
        alternatives[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                             "decoded_token": tokenizer.decode([entry.token_id])}
        out.append(alternatives)
    return out


def prompt_text(generation: Any) -> str:
    prompt = generation.body.prompt
    return prompt if isinstance(prompt, str) else generation.tokenizer.decode(generation.body.token_ids)


def echo_logprobs(generation: Any, entries: Sequence[TokenLogprob | None] | None,
                  completion: dict[str, Any] | None, *, shift: bool = True) -> dict[str, Any]:
    """The legacy logprobs of the prompt (from its prompt logprobs), then `completion`'s (whose
    offsets run on from the prompt's: `shift` them, unless they already do)."""
    tokenizer = generation.tokenizer
    ids = generation.body.token_ids
    tokens = [token_text(tokenizer, t) for t in ids]
    offset = len(prompt_text(generation))
    offsets = text_offsets(tokenizer, ids, offset)  # NOTE: the rules of engine.serve.logprob_format
    entries = list(entries or [None] * len(ids))
    token_logprobs = [None if e is None else e.logprob for e in entries]
    top = [None if e is None else legacy_top(tokenizer, text, e) for text, e in zip(tokens, entries)]
    if completion is None:
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
    return {"tokens": tokens + completion["tokens"], "token_logprobs": token_logprobs + completion["token_logprobs"],
            "top_logprobs": top + completion["top_logprobs"],
            "text_offset": offsets + [(offset if shift else 0) + o for o in completion["text_offset"]]}


def echo_choice(generation: Any, choice: Any, entry: dict[str, Any]) -> dict[str, Any]:
    """A whole completions choice with the prompt echoed in front (the prompt alone for max_tokens 0)."""
    only = generation.body.echo_only
    entry["text"] = prompt_text(generation) + ("" if only else entry["text"])
    if entry.get("logprobs") is not None:
        entry["logprobs"] = echo_logprobs(generation, choice.prompt_logprobs, None if only else entry["logprobs"])
    return entry


def stream_choice(generation: Any, chunk: Any, entry: dict[str, Any], *, first: bool) -> dict[str, Any]:
    """A streamed completions choice: the prompt's parts on a choice's first chunk (the echo, and
    `prompt_logprobs` when asked); with max_tokens 0 nothing of the output."""
    body = generation.body
    prompt_entries = generation.choices[chunk.index].prompt_logprobs
    if first and body.params.prompt_logprobs is not None:
        entry["prompt_logprobs"] = prompt_logprobs_json(generation.tokenizer, prompt_entries)
    if not body.echo or not (first or body.echo_only):
        return entry
    only = body.echo_only
    entry["text"] = (prompt_text(generation) if first else "") + ("" if only else entry["text"])
    if entry.get("logprobs") is not None:
        completion = None if only else entry["logprobs"]
        entry["logprobs"] = (echo_logprobs(generation, prompt_entries, completion, shift=False) if first
                             else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
    return entry

"""Request bodies of the HTTP server: parsed and validated before the engine sees them.

Every rejection is an `InvalidRequest` whose `field` is the body's own field
name (``sampling_params.temperature``, ``max_tokens``) and whose `limit`
says what the field must satisfy; the server answers it with 400. Nothing
here allocates: a body that fails never reaches the engine's pools.

    limits = Limits.for_engine(engine)
    body = parse_generate(parse_json(raw), limits, engine.tokenizer)

Accepted bodies (other fields are ignored with a warning, or refused when their loss would change
the answer: `engine.serve.field_policy`):

- ``POST /generate``: ``text`` or ``input_ids`` (exactly one),
  ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``,
  ``top_k``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``seed``, and
  SGLang's constraints ``json_schema``, ``regex``, ``ebnf``), ``stream``, ``rid``.
- ``POST /v1/completions``: ``model``, ``prompt`` (text, token ids, or a
  batch of one), ``max_tokens``, ``temperature``, ``top_p``, ``stop``
  (matched by the engine, `SamplingParams.stop`), ``seed``, ``n``,
  ``best_of`` (only equal to n), ``logprobs`` (k alternatives, 0 to 20),
  ``echo`` (with ``max_tokens`` 0: the prompt only), ``stream``,
  ``stream_options``; penalties, ``suffix`` and ``logit_bias`` only at
  their defaults; extensions ``top_k``, ``ignore_eos``, ``stop_token_ids``;
  a constraint as ``response_format`` or vLLM's fields
  (`engine.serve.structured_fields`).
- Issue 21's fields on each generation route (`scheduling_fields`):
  ``priority``, ``deadline``, ``prompt_logprobs``, ``session_params``,
  ``resume_output_ids``.
- ``POST /abort``: ``rid``.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from engine.config import SamplingParams
from engine.errors import InvalidRequest
from engine.serve.field_policy import unknown_field
from engine.serve import scheduling_fields
from engine.serve.scheduling_fields import SubmitFields, parse_submit_fields
from engine.serve.structured_fields import CONSTRAINT_FIELDS, GENERATE_FIELDS, chat_constraint, generate_constraint

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_RID_CHARS = 128


@attrs.frozen
class Limits:
    """What a prompt may be: token ids below `vocab_size`, at most `max_prompt_tokens` of them."""

    vocab_size: int
    max_context: int
    max_prompt_tokens: int
    model_name: str

    @classmethod
    def for_engine(cls, engine: Any, *, max_prompt_tokens: int | None = None, model_name: str | None = None) -> Limits:
        max_context = engine.max_context
        bound = max_context - 1 if max_prompt_tokens is None else min(max_prompt_tokens, max_context - 1)
        return cls(engine.model_config.vocab_size, max_context, bound, model_name or engine.config.model)


@attrs.frozen
class GenerateBody:
    """A validated generation request, in engine terms."""

    prompt: str | list[int]
    token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    rid: str | None = None
    include_usage: bool = False
    # -- issue 21 (engine.serve.scheduling_fields)
    submit: SubmitFields = attrs.field(factory=SubmitFields)
    #: completions: the answer starts with the prompt (and its logprobs); `echo_only`: max_tokens was 0
    echo: bool = False
    echo_only: bool = False
    #: the body field `params.constraint` came from (named by a compile error's 400)
    constraint_field: str | None = None
    #: chat answers: how the text becomes the message (reasoning, tool calls); None: all content
    chat: Any = None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (no NaN or Infinity, no lone UTF-16 surrogate in a string), or
    InvalidRequest naming 'body' or the field that holds the bad string."""

    def reject_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest("body", "a JSON object", f"malformed JSON ({exc})") from None
    except RecursionError:  # the decoder's own bound on nesting
        raise InvalidRequest("body", "a JSON object nested less deeply", "nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidRequest("body", "a JSON object", value)
    _check_text(value)
    return value


def _check_text(body: dict[str, Any]) -> None:
    """Every string is text that can be encoded: JSON's \\ud800 escapes can spell a lone surrogate,
    which no tokenizer (and no UTF-8 encoder) takes. Walks the body without recursion."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, field = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(field or "body", "valid Unicode text (no lone UTF-16 surrogate such as "
                                     "\\ud800)", value.encode("utf-8", errors="backslashreplace").decode()) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, field or "body"))
                stack.append((item, f"{field}.{key}" if field else key))
        elif isinstance(value, list):
            stack.extend((item, f"{field}[{i}]") for i, item in enumerate(value))


def known_fields(body: dict[str, Any], allowed: frozenset[str], prefix: str = "") -> None:
    """Fields outside `allowed` go to `engine.serve.field_policy`: ignored with one warning per field
    name, or a 400 if vLLM or SGLang would have changed the answer with them."""
    for key in body:
        if key not in allowed:
            unknown_field(prefix, key, body[key])


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(field, "true or false", value)
    return value


def _stop_strings(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(field, f"a string or a list of strings of 1 to {MAX_STOP_CHARS} characters", value)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(field, f"at most {MAX_STOP_STRINGS} stop strings", len(stops))
    return tuple(stops)


def prompt_ids(prompt: Any, field: str, limits: Limits, tokenizer: Any, *,
               add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text or token-id prompt, checked against the vocabulary and the bound; a text is
    encoded with the tokenizer's own special tokens (BOS) unless `add_special_tokens` is False."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest(field, "a non-empty string", prompt)
        if len(prompt) > limits.max_prompt_tokens * 16:  # NOTE: bounds tokenizer work before tokenizing
            raise InvalidRequest(field, f"at most {limits.max_prompt_tokens} tokens", f"{len(prompt)} characters")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, list):
        ids = prompt
        for t in ids:  # NOTE: a loop, not next(..., None): the bad value may itself be null
            if not (isinstance(t, int) and not isinstance(t, bool)):
                raise InvalidRequest(field, "a list of integer token ids", t)
            if not 0 <= t < limits.vocab_size:
                raise InvalidRequest(field, f"token ids in [0, {limits.vocab_size})", t)
    else:
        raise InvalidRequest(field, "a string or a list of token ids", prompt)
    if not ids:
        raise InvalidRequest(field, "at least 1 token", prompt)
    if len(ids) > limits.max_prompt_tokens:
        raise InvalidRequest(field, f"at most {limits.max_prompt_tokens} tokens", f"{len(ids)} tokens")
    return list(ids)


def _sampling(fields: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """SamplingParams(**fields); a validation error is renamed to the body's field name."""
    try:
        return SamplingParams(**fields)
    except InvalidRequest as exc:
        attribute = exc.field.removeprefix("SamplingParams.")
        raise InvalidRequest(names.get(attribute, attribute), exc.limit, exc.value) from None


def _check_context(num_prompt: int, max_new: int, field: str, limits: Limits) -> None:
    room = limits.max_context - num_prompt
    if max_new > room:
        raise InvalidRequest(field, f"<= max_context - prompt tokens = {limits.max_context} - {num_prompt} = {room}",
                             max_new)


_GENERATE = frozenset({"text", "input_ids", "sampling_params", "stream", "rid"}) | scheduling_fields.GENERATE
_SAMPLING = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                       "ignore_eos", "seed", *GENERATE_FIELDS})


def parse_generate(body: dict[str, Any], limits: Limits, tokenizer: Any) -> GenerateBody:
    """Validate a ``POST /generate`` body."""
    known_fields(body, _GENERATE)
    if ("text" in body) == ("input_ids" in body):
        raise InvalidRequest("text", "given, or input_ids given, but not both", sorted(set(body) & {"text", "input_ids"}))
    field = "text" if "text" in body else "input_ids"
    prompt = body[field]
    token_ids = prompt_ids(prompt, field, limits, tokenizer)
    sp = body.get("sampling_params", {})
    if not isinstance(sp, dict):
        raise InvalidRequest("sampling_params", "a JSON object", sp)
    known_fields(sp, _SAMPLING, "sampling_params.")
    stop = _stop_strings(sp.get("stop"), "sampling_params.stop")
    constraint, constraint_field = generate_constraint(sp)
    fields = {k: v for k, v in sp.items()
              if k in _SAMPLING and k != "stop" and k not in GENERATE_FIELDS and v is not None}
    names = {name: f"sampling_params.{name}" for name in _SAMPLING}
    params = _sampling({**fields, "stop": stop, "constraint": constraint}, names)
    _check_context(len(token_ids), params.max_new_tokens, "sampling_params.max_new_tokens", limits)
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_RID_CHARS and rid.isprintable()):
        raise InvalidRequest("rid", f"a printable string of 1 to {MAX_RID_CHARS} characters", rid)
    stream = _bool(body.get("stream", False), "stream")
    return GenerateBody(prompt, token_ids, params, stream=stream, rid=rid, constraint_field=constraint_field,
                        submit=parse_submit_fields(body))


_OPENAI_SAMPLING = frozenset({"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                              "stream_options", "n", "presence_penalty", "frequency_penalty", "user",
                              "logit_bias", "top_k", "ignore_eos", "stop_token_ids"})
_COMPLETION = (_OPENAI_SAMPLING | {"prompt", "best_of", "echo", "logprobs", "suffix", "add_special_tokens"}
               | scheduling_fields.COMPLETIONS | CONSTRAINT_FIELDS)
#: OpenAI fields accepted only at the value that means "off"
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "suffix": ("",), "logit_bias": ({},),
}


def check_default_only(body: dict[str, Any], fields: dict[str, tuple[Any, ...]]) -> None:
    """Fields this server does not support yet, accepted only at their "off" value."""
    for name, allowed in fields.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed):
            raise InvalidRequest(name, f"{allowed[0]!r} or absent (not supported)", value)


def served_model(body: dict[str, Any], limits: Limits) -> str:
    model = body.get("model", limits.model_name)
    if not isinstance(model, str):
        raise InvalidRequest("model", "a string", model)
    return model


def openai_body(body: dict[str, Any], token_ids: list[int], prompt: Any, limits: Limits, *,
                max_tokens_field: str = "max_tokens", default_max_tokens: int = 16,
                logprobs: tuple[str, Any] | None = None, constraint: Any = None, constraint_field: str | None = None,
                chat: Any = None) -> GenerateBody:
    """The sampling, stop and streaming fields shared by /v1/completions and /v1/chat/completions;
    `logprobs` is (the body field, the SamplingParams.logprobs value) when the request asks for them;
    `constraint` (from `constraint_field`) and `chat` (how chat answers are read) pass through."""
    fields: dict[str, Any] = {
        "max_new_tokens": default_max_tokens if body.get(max_tokens_field) is None else body[max_tokens_field],
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "stop": _stop_strings(body.get("stop"), "stop"),
    }
    for name in ("top_p", "top_k", "seed", "ignore_eos", "stop_token_ids", "n"):
        if body.get(name) is not None:
            fields[name] = body[name]
    names = {"max_new_tokens": max_tokens_field}
    if constraint is not None:
        fields["constraint"] = constraint
    if logprobs is not None:
        names["logprobs"], fields["logprobs"] = logprobs
    if body.get("prompt_logprobs") is not None:  # issue 21: vLLM's field
        fields["prompt_logprobs"] = body["prompt_logprobs"]
    params = _sampling(fields, names)
    _check_context(len(token_ids), params.max_new_tokens, max_tokens_field, limits)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options", "a JSON object", options)
    known_fields(options, frozenset({"include_usage", "continuous_usage_stats"}), "stream_options.")
    include_usage = _bool(options.get("include_usage", False), "stream_options.include_usage")
    stream = _bool(False if body.get("stream") is None else body["stream"], "stream")
    return GenerateBody(prompt, token_ids, params, stream=stream, include_usage=include_usage,
                        constraint_field=constraint_field, chat=chat, submit=parse_submit_fields(body))


def parse_completion(body: dict[str, Any], limits: Limits, tokenizer: Any) -> tuple[GenerateBody, str]:
    """Validate a ``POST /v1/completions`` body; returns it and the model name to answer with."""
    known_fields(body, _COMPLETION)
    check_default_only(body, DEFAULT_ONLY)
    model = served_model(body, limits)
    if "prompt" not in body:
        raise InvalidRequest("prompt", "given (text or token ids)", None)
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequest("prompt", "a single prompt (batches are not supported)", f"{len(prompt)} prompts")
        prompt = prompt[0]
    special = _bool(body.get("add_special_tokens", True), "add_special_tokens")  # vLLM's: a text prompt's BOS
    token_ids = prompt_ids(prompt, "prompt", limits, tokenizer, add_special_tokens=special)
    n, best_of = body.get("n"), body.get("best_of")
    if best_of is not None and best_of != (1 if n is None else n):
        raise InvalidRequest("best_of", "absent or equal to n (beam search is not supported)", best_of)
    logprobs = None if body.get("logprobs") is None else ("logprobs", body["logprobs"])
    echo = _bool(False if body.get("echo") is None else body["echo"], "echo")
    echo_only = echo and body.get("max_tokens") == 0  # the prompt's logprobs only (lm-eval's loglikelihood)
    if echo_only:
        body = {**body, "max_tokens": 1}
    if echo and logprobs is not None and body.get("prompt_logprobs") is None:
        body = {**body, "prompt_logprobs": body["logprobs"]}  # as vLLM: echo's logprobs cover the prompt
    constraint, field = chat_constraint(body)
    parsed = openai_body(body, token_ids, prompt, limits, logprobs=logprobs, constraint=constraint,
                         constraint_field=field)
    return attrs.evolve(parsed, echo=echo, echo_only=echo_only), model


def parse_abort(body: dict[str, Any]) -> str:
    """The request id of a ``POST /abort`` body."""
    known_fields(body, frozenset({"rid"}))
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest("rid", "a non-empty string", rid)
    return rid

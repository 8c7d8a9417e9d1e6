"""``POST /v1/chat/completions`` bodies: messages checked, rendered with the chat template, tokenized.

    body, model = parse_chat(raw, limits, engine.tokenizer, template)

Accepted (other fields as for completions: `engine.serve.field_policy`):

- ``messages``: a non-empty list of ``{"role", "content", "name"?}`` with
  role ``system``, ``developer``, ``user`` or ``assistant``; ``content`` a
  string or a list of ``{"type": "text", "text": ...}`` parts (joined with
  newlines, as vLLM does for text-only templates). An assistant message may
  have ``content: null``.
- the sampling fields of /v1/completions (``max_tokens``, also under its
  newer name ``max_completion_tokens``; ``temperature``, ``top_p``,
  ``stop``, ``seed``, ``stream``, ``stream_options``, and the ``top_k``,
  ``ignore_eos``, ``stop_token_ids`` extensions); ``max_tokens`` defaults to
  what is left of the context after the prompt; ``n``; ``logprobs`` (true)
  with ``top_logprobs`` (0 to 20); stop strings are matched by the engine;
- ``add_generation_prompt`` (default true) and ``chat_template_kwargs``
  (extra template variables, e.g. ``{"enable_thinking": false}``), as vLLM
  takes them.

Refused clearly: ``tools``, ``tool_choice`` other than "none",
``functions``, ``function_call``, tool messages and tool calls (400 on the
field, "not supported"); image and audio parts; ``response_format`` other
than text; penalties and ``logit_bias`` except at their "off" values.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest
from engine.serve.chat_template import ChatTemplate, ChatTemplateError
from engine.serve import scheduling_fields
from engine.serve.schemas import (GenerateBody, Limits, check_default_only, known_fields, openai_body, prompt_ids,
                                  served_model)

ROLES = frozenset({"system", "developer", "user", "assistant"})
_TOOL_FIELDS = ("tools", "functions", "function_call", "parallel_tool_calls")
_CHAT = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
                   "seed", "stream", "stream_options", "n", "logprobs", "top_logprobs", "presence_penalty",
                   "frequency_penalty", "user", "logit_bias", "response_format", "tool_choice",
                   "add_generation_prompt", "chat_template_kwargs", "top_k", "ignore_eos", "stop_token_ids",
                   "add_special_tokens",
                   *_TOOL_FIELDS})
_CHAT_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {"presence_penalty": (0,), "frequency_penalty": (0,),
                                                  "logit_bias": ({},)}
#: template variables a request may not override
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _refuse_tools(body: dict[str, Any]) -> None:
    for name in _TOOL_FIELDS:
        if body.get(name) not in (None, [], False):
            raise InvalidRequest(name, "absent: tool and function calling are not supported by this server",
                                 body[name])
    choice = body.get("tool_choice")
    if choice not in (None, "none"):
        raise InvalidRequest("tool_choice", "'none' or absent: tool calling is not supported by this server",
                             choice)


def _content(value: Any, field: str, role: str) -> str | None:
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return None
    if not isinstance(value, list) or not value:
        raise InvalidRequest(field, "a string or a non-empty list of text parts", value)
    texts = []
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else part
            raise InvalidRequest(f"{field}[{i}]", "a text part {'type': 'text', 'text': ...} "
                                 "(images and audio are not supported)", kind)
        known_fields(part, frozenset({"type", "text"}), f"{field}[{i}].")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{field}[{i}].text", "a string", part.get("text"))
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """The messages as the template sees them: role, content (a string, or None), name when given."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages", "a non-empty list of messages", value)
    messages = []
    for i, message in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(field, "a JSON object with role and content", message)
        role = message.get("role")
        if role == "tool" or message.get("tool_calls") or "tool_call_id" in message:
            raise InvalidRequest(f"{field}.role", "not a tool message or tool call: tool calling is not supported",
                                 role)
        known_fields(message, frozenset({"role", "content", "name"}), f"{field}.")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(f"{field}.role", f"one of {', '.join(sorted(ROLES))}", role)
        if "content" not in message:
            raise InvalidRequest(f"{field}.content", "given (a string or a list of text parts)", None)
        entry = {"role": role, "content": _content(message["content"], f"{field}.content", role)}
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise InvalidRequest(f"{field}.name", "a string", message["name"])
            entry["name"] = message["name"]
        messages.append(entry)
    return messages


def _template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs", "a JSON object of template variables", value)
    reserved = sorted(_RESERVED & set(value))
    if reserved:
        raise InvalidRequest("chat_template_kwargs", f"free of {', '.join(sorted(_RESERVED))}", reserved)
    return value


def parse_chat(body: dict[str, Any], limits: Limits, tokenizer: Any,
               template: ChatTemplate) -> tuple[GenerateBody, str]:
    """Validate a ``POST /v1/chat/completions`` body and render its prompt; returns it and the model name."""
    _refuse_tools(body)
    known_fields(body, _CHAT | scheduling_fields.CHAT)  # issue 21: priority, deadline, prompt_logprobs
    check_default_only(body, _CHAT_DEFAULT_ONLY)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise InvalidRequest("response_format", "{'type': 'text'} or absent (structured output is not supported)",
                             response_format)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise InvalidRequest("max_completion_tokens", "given without max_tokens (they are the same field)",
                             body["max_completion_tokens"])
    model = served_model(body, limits)
    messages = parse_messages(body.get("messages"))
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise InvalidRequest("add_generation_prompt", "true or false", add_generation_prompt)
    try:
        prompt = template.render(messages, add_generation_prompt=add_generation_prompt,
                                 extra=_template_kwargs(body.get("chat_template_kwargs")))
    except ChatTemplateError as exc:
        raise InvalidRequest("messages", "accepted by the model's chat template", str(exc)) from None
    special = body.get("add_special_tokens")  # vLLM's; by default as the template needs (chat_template)
    if special is not None and not isinstance(special, bool):
        raise InvalidRequest("add_special_tokens", "true or false", special)
    token_ids = prompt_ids(prompt, "messages", limits, tokenizer,
                           add_special_tokens=template.add_special_tokens if special is None else special)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max(1, limits.max_context - len(token_ids))
    return openai_body(body, token_ids, prompt, limits, max_tokens_field=field, default_max_tokens=room,
                       logprobs=_logprobs(body)), model


def _logprobs(body: dict[str, Any]) -> tuple[str, Any] | None:
    """Chat's `logprobs: true` (+ `top_logprobs: k`) as (field, SamplingParams.logprobs)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequest("logprobs", "true or false", wanted)
    if not wanted:
        if top is not None:
            raise InvalidRequest("top_logprobs", "absent unless logprobs is true", top)
        return None
    return ("top_logprobs", 0 if top is None else top)

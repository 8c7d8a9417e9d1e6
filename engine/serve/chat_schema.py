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
  takes them;
- a constraint: ``response_format`` or vLLM's fields
  (`engine.serve.structured_fields`); ``tools``, ``tool_choice``,
  ``parallel_tool_calls``, and ``tool`` messages and assistant
  ``tool_calls`` (`engine.serve.tools`); how the answer is read (reasoning,
  tool calls) is `GenerateBody.chat` (`engine.serve.chat_output`).

Refused clearly: the legacy ``functions`` and ``function_call``; image and
audio parts; penalties and ``logit_bias`` except at their "off" values.
"""

from __future__ import annotations

from typing import Any

import attrs

from engine.errors import InvalidRequest
from engine.serve.chat_output import ChatOutputSpec
from engine.serve.chat_template import ChatTemplate, ChatTemplateError
from engine.serve import scheduling_fields
from engine.serve.reasoning import END, initial_state
from engine.serve.schemas import (GenerateBody, Limits, check_default_only, known_fields, openai_body, prompt_ids,
                                  served_model)
from engine.serve.structured_fields import CONSTRAINT_FIELDS, chat_constraint
from engine.serve.tools import parse_tools, tool_message_fields

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_TOOL_FIELDS = ("tools", "functions", "function_call", "parallel_tool_calls")
_CHAT = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
                   "seed", "stream", "stream_options", "n", "logprobs", "top_logprobs", "presence_penalty",
                   "frequency_penalty", "user", "logit_bias", "tool_choice",
                   "add_generation_prompt", "chat_template_kwargs", "top_k", "ignore_eos", "stop_token_ids",
                   "add_special_tokens",
                   *_TOOL_FIELDS, *CONSTRAINT_FIELDS})
_CHAT_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {"presence_penalty": (0,), "frequency_penalty": (0,),
                                                  "logit_bias": ({},)}
#: template variables a request may not override
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _content(value: Any, field: str, role: str) -> str | None:
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":  # e.g. a message that only calls tools
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
    """The messages as the template sees them: role, content (a string, or None), name when given,
    and an assistant's tool_calls or a tool message's tool_call_id."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages", "a non-empty list of messages", value)
    messages = []
    for i, message in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(field, "a JSON object with role and content", message)
        role = message.get("role")
        tool_parts = tool_message_fields(message, field)
        known_fields(message, frozenset({"role", "content", "name", "tool_calls", "tool_call_id"}), f"{field}.")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(f"{field}.role", f"one of {', '.join(sorted(ROLES))}", role)
        if "content" not in message and "tool_calls" not in tool_parts:
            raise InvalidRequest(f"{field}.content", "given (a string or a list of text parts)", None)
        entry = {"role": role, "content": _content(message.get("content"), f"{field}.content", role), **tool_parts}
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


def parse_chat(body: dict[str, Any], limits: Limits, tokenizer: Any, template: ChatTemplate, *,
               tool_parser: str | None = None, reasoning_parser: str | None = None) -> tuple[GenerateBody, str]:
    """Validate a ``POST /v1/chat/completions`` body and render its prompt; returns it and the model name.
    `tool_parser` and `reasoning_parser` are the server's (`--tool-call-parser`, `--reasoning-parser`)."""
    known_fields(body, _CHAT | scheduling_fields.CHAT)  # issue 21: priority, deadline, prompt_logprobs
    tools = parse_tools(body, tool_parser)
    constraint, constraint_field = chat_constraint(body)
    check_default_only(body, _CHAT_DEFAULT_ONLY)
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
                                 extra=_template_kwargs(body.get("chat_template_kwargs")),
                                 tools=None if tools is None else tools.template_tools)
    except ChatTemplateError as exc:
        raise InvalidRequest("messages", "accepted by the model's chat template", str(exc)) from None
    special = body.get("add_special_tokens")  # vLLM's; by default as the template needs (chat_template)
    if special is not None and not isinstance(special, bool):
        raise InvalidRequest("add_special_tokens", "true or false", special)
    token_ids = prompt_ids(prompt, "messages", limits, tokenizer,
                           add_special_tokens=template.add_special_tokens if special is None else special)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max(1, limits.max_context - len(token_ids))
    reasoning = None if reasoning_parser is None else initial_state(reasoning_parser, prompt)
    starts_after = END if reasoning in ("reasoning", "auto") else None  # the grammar applies to the answer
    tool_constraint = None if tools is None else tools.constraint(starts_after=starts_after)
    if tool_constraint is not None:
        if constraint is not None:
            raise InvalidRequest(constraint_field or "response_format", "absent when tool_choice is 'required' or "
                                 "a named function (the tools' grammar constrains the answer)", "a constraint")
        constraint, constraint_field = tool_constraint, "tools"
    elif constraint is not None and starts_after is not None:
        constraint = attrs.evolve(constraint, starts_after=starts_after)
    reads_tools = tools is not None and tools.choice != "none"
    chat = ChatOutputSpec(reasoning, tools if reads_tools else None) if reasoning or reads_tools else None
    return openai_body(body, token_ids, prompt, limits, max_tokens_field=field, default_max_tokens=room,
                       logprobs=_logprobs(body), constraint=constraint, constraint_field=constraint_field,
                       chat=chat), model


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

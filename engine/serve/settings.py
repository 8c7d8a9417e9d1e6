"""ServerSettings: the HTTP layer's bounds, timeouts and access (the engine's own are in EngineConfig).

Validated at construction with `InvalidConfig` naming the field and the
limit, as EngineConfig is: ``ServerSettings.max_body_bytes must be an
integer >= 1, got 0``. The API key is kept out of `repr` so no log line or
traceback can show it.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from engine.errors import InvalidConfig
from engine.serve.reasoning import REASONING_PARSERS
from engine.serve.tool_parsers import TOOL_PARSERS


def _int_at_least(low: int, *, optional: bool = False):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            limit = f"an integer >= {low}" + (" or None" if optional else "")
            raise InvalidConfig(f"ServerSettings.{attribute.name}", limit, value)

    return check


def _positive_seconds(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise InvalidConfig(f"ServerSettings.{attribute.name}", "a finite number of seconds > 0", value)


def _optional_seconds(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _positive_seconds(inst, attribute, value)


def _optional_text(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidConfig(f"ServerSettings.{attribute.name}", "None or a non-empty string",
                            "<hidden>" if attribute.name == "api_key" else value)


def _flag(inst: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidConfig(f"ServerSettings.{attribute.name}", "True or False", value)


def _parser_name(choices: Any):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value not in choices:
            raise InvalidConfig(f"ServerSettings.{attribute.name}", f"None or one of {', '.join(sorted(choices))}",
                                value)

    return check


@attrs.frozen
class ServerSettings:
    max_body_bytes: int = attrs.field(default=1 << 20, validator=_int_at_least(1))
    #: None: max_context - 1
    max_prompt_tokens: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    #: generation requests at once; None: max_running + max_queued
    max_inflight: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    #: a health probe must finish within this; a busy engine must have made progress within it
    health_timeout: float = attrs.field(default=10.0, validator=_positive_seconds)
    retry_after_s: int = attrs.field(default=1, validator=_int_at_least(0))
    served_model_name: str | None = attrs.field(default=None, validator=_optional_text)
    graceful_timeout: float = attrs.field(default=10.0, validator=_positive_seconds)
    #: None: no access control; else every route but /health and /live needs `Authorization: Bearer <key>`
    api_key: str | None = attrs.field(default=None, validator=_optional_text, repr=False)
    #: issue 21: seconds a generation request may take when its body gives no `deadline` (None: no deadline)
    default_deadline: float | None = attrs.field(default=None, validator=_optional_seconds)
    #: a streamed sequence's tokens per event (SGLang's and vLLM's `--stream-interval`): its first token
    #: and its last event go at once, the others once this many are ready; 1: an event per output
    stream_interval: int = attrs.field(default=1, validator=_int_at_least(1))
    #: how tool calls are read from a model's text (`tool_choice` "auto"); None: "auto" is refused
    tool_call_parser: str | None = attrs.field(default=None, validator=_parser_name(TOOL_PARSERS))
    #: how a reasoning model's thinking is split into `reasoning_content`; None: it stays content
    reasoning_parser: str | None = attrs.field(default=None, validator=_parser_name(REASONING_PARSERS))
    #: also export the router-read metrics under vLLM's names (`vllm:num_requests_waiting`, ...)
    vllm_metric_names: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: an `engine.kv_events.KVEventsConfig`: publish KV cache events (the `kv-events` extra); None: off
    kv_events: Any = attrs.field(default=None)
    #: the HTTP layer in a process of its own (`engine.serve.api_process`): the generation routes' parsing,
    #: tokenizing and writing run there, off the engine's GIL; the other routes pass through to this one
    api_process: bool = attrs.field(default=False, validator=_flag)

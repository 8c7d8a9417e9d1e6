"""Chat templates, rendered the way transformers' `apply_chat_template` renders them.

    template = ChatTemplate.for_model(engine.config.model)
    prompt = template.render(messages, add_generation_prompt=True)
    token_ids = engine.tokenizer.encode(prompt, add_special_tokens=template.add_special_tokens)

A checkpoint's own template writes every special token itself (``{{ bos_token }}``),
so its text is encoded adding none (`add_special_tokens` is False): the ids are
transformers' ``apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)``, which encodes the same way. The built-in default writes none,
so its text is encoded like any prompt, with the tokenizer's own BOS.

Where the template comes from, as transformers reads a checkpoint directory:
``chat_template.jinja`` if present, else ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates, of which
"default" is used). The special tokens the template sees (`bos_token`,
`eos_token`, `unk_token`, `pad_token`) come from ``tokenizer_config.json``,
else ``special_tokens_map.json``, as strings. The built-in models, and a
checkpoint without a template, use `DEFAULT_TEMPLATE` (``role: content``
lines, then ``assistant:``).

Rendering matches transformers: a sandboxed (immutable) jinja2 environment
with ``trim_blocks`` and ``lstrip_blocks`` and the ``loopcontrols``
extension; a ``tojson`` filter that does not escape HTML; the globals
``raise_exception`` (raises `ChatTemplateError`, answered as a 400, as is
any other error the template raises on the messages, e.g. string operations
on an assistant's ``content: null``),
``strftime_now``, a ``namespace`` that refuses underscore names, and the template variables ``messages``, ``tools``
(the request's tools, OpenAI's shape, or None), ``documents``, ``add_generation_prompt``
and the special tokens. Chat templates from the Hub are untrusted code: the
sandbox refuses attribute access to Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """A chat template that does not load, or refuses the messages (its `raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()`, refusing underscore names (no way to reach Python internals through it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # NOTE: jinja's own signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        fields = dict(*args, **kwargs)
        for name in fields:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, fields)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateError(f"chat templates cannot set underscore names on a namespace ({name!r})")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["namespace"] = _Namespace
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object")
    return value


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *, origin: str = "given",
                 add_special_tokens: bool = False) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        #: whether the rendered text is encoded with the tokenizer's own special tokens (BOS): only for
        #: the built-in default, which writes none; a checkpoint's template writes its own
        self.add_special_tokens = add_special_tokens
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template from {origin} does not compile: {exc}") from None

    @classmethod
    def for_model(cls, model: str) -> ChatTemplate:
        """The template of checkpoint directory `model`, or the default for a built-in model."""
        directory = Path(model)
        if not directory.is_dir():
            return cls(DEFAULT_TEMPLATE, origin="the built-in default", add_special_tokens=True)
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        special_map_path = directory / "special_tokens_map.json"
        special_map = _read_json(special_map_path) if special_map_path.is_file() else {}
        special = {}
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name)) or _token_text(special_map.get(name))
            if text is not None:
                special[name] = text
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            return cls(jinja_path.read_text(encoding="utf-8"), special, origin=str(jinja_path))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return cls(DEFAULT_TEMPLATE, special, origin="the built-in default (the checkpoint has none)",
                       add_special_tokens=True)
        if not isinstance(source, str):
            raise ChatTemplateError(f"{config_path}: chat_template must be a string or a list of named templates")
        return cls(source, special, origin=str(config_path))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text; ChatTemplateError if the template refuses the messages."""
        variables = {**self.special_tokens, **(extra or {})}
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # sandbox refusals, undefined calls, template bugs
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - e.g. `content + ...` on a null content: the messages' fault
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
                                    ) from None

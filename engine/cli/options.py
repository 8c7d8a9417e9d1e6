"""Options every `kvlife` command shares: the EngineConfig fields, HiSparse, plugins; checked argument types.

    add_engine_options(parser, defaults={"num_kv_pages": 160})   # this command's own defaults, shown in --help
    config = engine_config_from_args(args)                         # InvalidConfig names the field and the limit

Argument types reject a bad value at parse time, so argparse reports it as
one ``kvlife: argument --port: ...`` line with exit code 2; EngineConfig
and HiSparseConfig check the rest with their own messages.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import attrs

from engine.config import EngineConfig


class CLIError(Exception):
    """A bad value or environment the user can fix: printed as one `kvlife: ...` line, exit code 2."""


def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def non_negative_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535] (0 picks a free one), got {text!r}")
    return value


def non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must be a non-empty string")
    return text


#: (EngineConfig field, type, help)
ENGINE_OPTIONS: list[tuple[str, type, str]] = [
    ("model", str, "'tiny', 'tiny-moe', 'null' (no compute) or a checkpoint directory"),
    ("device", str, "torch device, e.g. cpu or cuda"),
    ("dtype", str, "float32, float16 or bfloat16"),
    ("kv_cache_dtype", str, "dtype the KV cache is stored in: auto (the model's), float32, float16 or bfloat16"),
    ("seed", int, "seed of the built-in model's weights"),
    ("page_size", int, "tokens per KV page"),
    ("num_kv_pages", int, "KV pages in the pool (page 0 is reserved)"),
    ("max_running", int, "requests running at once"),
    ("max_context", int, "prompt + output tokens per request"),
    ("max_prefill_tokens", int, "prefill tokens per step (chunked prefill)"),
    ("max_queued", int, "requests that may wait in the engine's inbox"),
    ("disaggregation", str, "this engine's role"),
    ("leak_check", str, "raise, log or off"),
    ("fence_timeout", float, "seconds a fence may stay pending before its handle is quarantined"),
    ("inline_step_tokens", int, "steps of at most this many tokens run on the event loop's thread, larger ones "
                                "on the loop's step thread"),
    ("inline_step_ms", float, "on a CPU, steps expected to end within this many milliseconds run on the event "
                              "loop's thread too (0: tokens alone decide)"),
    ("decode_steps", int, "the most decode steps a batch runs back to back before the loop plans again (tokens "
                          "stream in bursts of up to this many; 1: every step planned)"),
    ("starvation_timeout", float, "seconds a request may wait for memory before it is reported starved "
                                  "(after a leak check naming what it waits for)"),
    # issue 21 (docs/scheduling.md)
    ("priority_aging", float, "seconds of waiting worth one priority step (bounds the lowest class's wait)"),
    ("max_sessions", int, "sessions open at once (0: none)"),
    ("session_idle_timeout", float, "seconds after its latest turn a session closes"),
    ("session_max_pages", int, "KV pages one session may keep"),
]
#: the `--disaggregation` roles of every command (serve adds "prefill", a prefill server)
ROLES = ("none", "decode")
#: (HiSparseConfig field, help)
HISPARSE_OPTIONS: list[tuple[str, str]] = [
    ("top_k", "enable HiSparse, attending over the top K tokens per decode step"),
    ("device_buffer_size", "HiSparse device KV slots per request (>= top-k)"),
    ("recent_window", "HiSparse: the last tokens always attended (within top-k)"),
]
#: SpeculativeConfig fields as --speculative-* options (any of them turns speculation on)
SPECULATIVE_OPTIONS: list[tuple[str, type, str]] = [
    ("method", str, "'ngram' (prompt lookup, the default) or 'draft_model'"),
    ("num_tokens", int, "draft tokens verified per step and request (default 4)"),
    ("ngram_max", int, "prompt lookup: the longest n-gram matched (default 3)"),
    ("draft_model", str, "the draft model: 'tiny' or a checkpoint directory with the target's tokenizer"),
]
_CONFIG_DEFAULTS = {f.name: f.default for f in attrs.fields(EngineConfig)}


def add_engine_options(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None, *,
                       roles: tuple[str, ...] = ROLES) -> None:
    """The EngineConfig fields as options; `defaults` are this command's own, shown in --help; `roles`
    the `--disaggregation` values this command takes (a bad one is refused listing them)."""
    defaults = defaults or {}
    group = parser.add_argument_group("engine options (EngineConfig fields)")
    for name, kind, help_text in ENGINE_OPTIONS:
        shown = defaults.get(name, _CONFIG_DEFAULTS[name])
        shown = "derived from the pool and the model" if shown is None else shown
        choices = roles if name == "disaggregation" else None
        if choices:
            help_text = f"{help_text}: {', '.join(roles)}"
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=defaults.get(name),
                           choices=choices, help=f"{help_text} (default: {shown})")
    group.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                       help="turn the radix prefix cache off")
    group.add_argument("--no-plugins", dest="use_entry_points", action="store_false", default=None,
                       help="do not load resource-hook plugins from entry points")
    hisparse = parser.add_argument_group("HiSparse options (any of them turns HiSparse on)")
    for name, help_text in HISPARSE_OPTIONS:
        hisparse.add_argument(f"--hisparse-{name.replace('_', '-')}", dest=f"hisparse_{name}", type=int,
                              default=None, help=help_text)
    speculative = parser.add_argument_group("speculative decoding (any of them turns it on; docs/speculative.md)")
    for name, kind, help_text in SPECULATIVE_OPTIONS:
        speculative.add_argument(f"--speculative-{name.replace('_', '-')}", dest=f"speculative_{name}", type=kind,
                                 default=None, help=help_text)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the options name (InvalidConfig if a value is out of range)."""
    fields = {name: getattr(args, name) for name, _, _ in ENGINE_OPTIONS if getattr(args, name, None) is not None}
    for name in ("prefix_cache", "use_entry_points"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    hisparse = {name: getattr(args, f"hisparse_{name}") for name, _ in HISPARSE_OPTIONS
                if getattr(args, f"hisparse_{name}", None) is not None}
    if hisparse:
        from hisparse import HiSparseConfig

        fields["hisparse"] = HiSparseConfig(**hisparse)
    speculative = {name: getattr(args, f"speculative_{name}") for name, _, _ in SPECULATIVE_OPTIONS
                   if getattr(args, f"speculative_{name}", None) is not None}
    if speculative:
        from engine.speculative import SpeculativeConfig

        if "draft_model" in speculative:
            speculative.setdefault("method", "draft_model")
        fields["speculative"] = SpeculativeConfig(**speculative)
    fields.update(overrides)
    return EngineConfig(**fields)


def writable_path(path: str) -> Path:
    """`path` can be written (checked before a long run, not after it), else CLIError.

    NOTE: checked by opening it for appending (and removing it again if that created it), not with
    os.access: permission bits say nothing for root, nor for /proc, read-only mounts or quotas."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise CLIError(f"--json {path}: is a directory")
    if not parent.is_dir():
        raise CLIError(f"--json {path}: directory {parent} does not exist")
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise CLIError(f"--json {path}: not writable ({exc.strerror or exc})") from None
    if not existed:
        target.unlink(missing_ok=True)
    return target


def logging_choice(args: argparse.Namespace) -> tuple[str, bool]:
    """(level, json) from --log-level / --log-json wherever given, else the command's defaults."""
    level = args.log_level or args.default_log_level
    json_logs = args.log_json if args.log_json is not None else getattr(args, "default_log_json", False)
    return level, json_logs


def write_text(target: Path, text: str) -> None:
    """Write a file the user named; an OSError is a CLIError (one line, exit 2), never a traceback."""
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"--json {target}: could not be written ({exc.strerror or exc})") from None

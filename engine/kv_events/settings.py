"""KVEventsConfig: where and how kvlife publishes its KV cache events (validated at construction,
`InvalidConfig` naming the field, like EngineConfig).

- `endpoint` (``tcp://127.0.0.1:5557``): the PUB socket. Loopback by default: vLLM's default
  binds every interface, kvlife's does not; give ``tcp://0.0.0.0:5557`` (or a pod IP) to publish
  to other hosts. With `connect` the publisher dials a subscriber that binds instead (llm-d's
  "central" indexer binds ``tcp://*:5557`` and every model server connects to it).
- `replay_endpoint` (``tcp://127.0.0.1:5558``; None: no replay): a ROUTER socket that always
  binds; a subscriber that missed batches asks for every buffered batch from a sequence number.
- `buffer_steps` (10,000): how many past batches replay keeps.
- `topic` (""): the first frame of every message; llm-d's convention is
  ``kv@<pod-ip>:<port>@<model>``.
- `hash_seed` (``vllm-none-hash``): the seed of the first page's parent hash; vLLM 0.33.0 uses this
  string when PYTHONHASHSEED is unset, and llm-d's token processor must be given the same seed.
- `medium` (None: "GPU" on a CUDA device, else "CPU"): the tier every event names.
- `hwm` (100,000): the PUB socket's high-water mark (messages a slow subscriber may fall behind).
"""

from __future__ import annotations

from typing import Any

import attrs

from engine.errors import InvalidConfig

_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _endpoint(optional: bool):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if not (isinstance(value, str) and value.startswith(_SCHEMES) and len(value) > 6):
            limit = "a ZeroMQ endpoint (tcp://host:port, ipc://path or inproc://name)"
            raise InvalidConfig(f"KVEventsConfig.{attribute.name}", limit + (" or None" if optional else ""), value)

    return check


def _positive_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise InvalidConfig(f"KVEventsConfig.{attribute.name}", "an integer >= 1", value)


def _text(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidConfig(f"KVEventsConfig.{attribute.name}", "a string", value)


def _medium(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidConfig("KVEventsConfig.medium", "None or a non-empty string (GPU, CPU, ...)", value)


@attrs.frozen
class KVEventsConfig:
    endpoint: str = attrs.field(default="tcp://127.0.0.1:5557", validator=_endpoint(False))
    replay_endpoint: str | None = attrs.field(default="tcp://127.0.0.1:5558", validator=_endpoint(True))
    connect: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    topic: str = attrs.field(default="", validator=_text)
    buffer_steps: int = attrs.field(default=10_000, validator=_positive_int)
    hwm: int = attrs.field(default=100_000, validator=_positive_int)
    hash_seed: str = attrs.field(default="vllm-none-hash", validator=_text)
    medium: str | None = attrs.field(default=None, validator=_medium)

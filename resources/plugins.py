"""Plugin resource hooks: from the engine config and from entry points.

A plugin is a resource hook (see `resources.contract`: a `ResourceHook`
subclass or any object with the protocol's members) or a factory
``factory(context) -> hook`` taking a `PluginContext`. Installed packages
publish factories in the entry point group ``kvlife.resources``::

    [project.entry-points."kvlife.resources"]
    gpu_lease = "my_package.hooks:make_lease_hook"

A hook that owns memory names its pool in `pool` and exposes the pool (an
object with `name` and `stats() -> PoolUsage`) in a `pools` attribute, so
the leak check covers it; the machine records what each request holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

import attrs

ENTRY_POINT_GROUP = "kvlife.resources"


class PluginError(ValueError):
    """A plugin could not be loaded or built; the message names it."""


@attrs.frozen
class PluginContext:
    """What a hook factory is given: the engine's torch device and its config."""

    device: Any
    config: Any


def is_hook_instance(source: Any) -> bool:
    """A hook object (used as is), as opposed to a factory (called with the context)."""
    return hasattr(source, "release") and not isinstance(source, type)


def build_plugin_hooks(
    configured: Iterable[Any], context: PluginContext, *, use_entry_points: bool = True
) -> list[Any]:
    """Instantiate configured hooks, then entry-point hooks (sorted by name), in that order."""
    sources: list[tuple[str, Any]] = [(repr(source), source) for source in configured]
    if use_entry_points:
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            try:
                sources.append((f"entry point {ep.name!r} ({ep.value})", ep.load()))
            except Exception as exc:
                raise PluginError(f"plugin entry point {ep.name!r} ({ep.value}) failed to load: {exc!r}") from exc
    hooks = []
    for label, source in sources:
        if is_hook_instance(source):
            hooks.append(source)
            continue
        try:
            hooks.append(source(context))
        except Exception as exc:
            raise PluginError(f"plugin {label} failed to build its hook: {exc!r}") from exc
    return hooks

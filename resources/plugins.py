"""Plugin resource hooks: from the engine config and from entry points.

A plugin is a `ResourceHook` (see `resources.contract`) or a factory
``factory(context) -> ResourceHook`` taking a `PluginContext`. Installed
packages publish factories in the entry point group ``kvlife.resources``::

    [project.entry-points."kvlife.resources"]
    gpu_lease = "my_package.hooks:make_lease_hook"

A hook that owns memory should account it in `context.ledger` and expose
its pools as a `pools` attribute so the leak check covers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

import attrs

from resources.ledger import Ledger

ENTRY_POINT_GROUP = "kvlife.resources"


@attrs.frozen
class PluginContext:
    ledger: Ledger
    device: Any
    config: Any


def build_plugin_hooks(
    configured: Iterable[Any], context: PluginContext, *, use_entry_points: bool = True
) -> list[Any]:
    """Instantiate configured hooks, then entry-point hooks, in that order."""
    sources = list(configured)
    if use_entry_points:
        sources += [ep.load() for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)]
    hooks = []
    for source in sources:
        is_instance = hasattr(source, "release") and not isinstance(source, type)
        hook = source if is_instance else source(context)
        hooks.append(hook)
    return hooks

"""Plugin hooks: from `EngineConfig.resources` and the `kvlife.resources` entry points."""

from __future__ import annotations

from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from resources.ledger import Pool
from resources.plugins import PluginContext, build_plugin_hooks


def install_plugins(ctx: BuildContext, so_far: Installed) -> FeatureInstall | None:
    config = ctx.config
    hooks = build_plugin_hooks(config.resources, PluginContext(ctx.device, config),
                               use_entry_points=config.use_entry_points)
    if not hooks:
        return None
    pools: list[Pool] = [pool for hook in hooks for pool in getattr(hook, "pools", ())]
    return FeatureInstall(hooks=hooks, pools=pools)

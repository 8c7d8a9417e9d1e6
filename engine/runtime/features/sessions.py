"""Sessions (issue 21): the kept KV of open conversations, a lease with its own hooks."""

from __future__ import annotations

from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from resources.session_hook import SessionStore


def install_sessions(ctx: BuildContext, so_far: Installed) -> FeatureInstall | None:
    if not ctx.config.max_sessions:
        return None
    store = SessionStore(ctx.kv_pool, ctx.config.max_sessions)
    return FeatureInstall(hooks=list(store.hooks), pools=[store.pool], sessions=store)

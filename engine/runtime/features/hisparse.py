"""HiSparse: its hooks and pools, sparse decode attention, and STAGING after the first token.

Device KV pages are held only until the prompt is on the host (the KV and
slot hooks' narrowed scope), and a decode-role transfer lands straight in the
request's host rows (`landing`), so such a request takes no device KV page
and no request slot at all (the KV hooks acquire on PREFILLING only).
"""

from __future__ import annotations

import attrs

from engine.disagg.decode.destination import HostLanding
from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from hisparse.integration import install_hisparse as build_hisparse
from states import RequestState

S = RequestState


def install_hisparse(ctx: BuildContext, so_far: Installed) -> FeatureInstall | None:
    if ctx.config.hisparse is None:
        return None
    hs = build_hisparse(config=ctx.config, max_context=ctx.max_context, model_config=ctx.model_config,
                        device=ctx.device, kv_pool=ctx.kv_pool, kv_buffers=ctx.kv_buffers, faults=ctx.faults)
    return FeatureInstall(hooks=hs.hooks, pools=hs.pools, attention=hs.attention_factory, slot_of=hs.slot_of,
                          kv_scope=hs.kv_scope, kv_acquire_on=frozenset({S.PREFILLING}),
                          landing=HostLanding(hs.state),
                          role=lambda role: attrs.evolve(role, after_prefill=S.STAGING))

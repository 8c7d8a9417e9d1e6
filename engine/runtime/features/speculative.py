"""Speculative decoding (`EngineConfig.speculative`): the runner's verify step, and with a draft
model its KV hook (`spec_draft_kv`, released after the request's KV) and pool. Not installed in
the prefill role, which never decodes."""

from __future__ import annotations

from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from engine.speculative.install import install_speculation


def install_speculative(ctx: BuildContext, so_far: Installed) -> FeatureInstall | None:
    if ctx.config.speculative is None or so_far.role.after_prefill is None:
        return None
    speculation = install_speculation(ctx.config, model_config=ctx.model_config, device=ctx.device,
                                      max_context=ctx.max_context)
    return FeatureInstall(hooks=list(speculation.hooks), pools=list(speculation.pools),
                          step_extension=speculation.step)

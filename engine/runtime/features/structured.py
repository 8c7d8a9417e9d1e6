"""Structured outputs: the grammar hook (released after the request's memory, acquired before
it), its check of each sampled token, and the sampled rows' allowed-token masks for the runner.

Always installed: without llguidance, or with structured outputs off, it carries only why
constraints are refused (`StructuredInstall`), and no hook.
"""

from __future__ import annotations

from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from engine.structured.install import install_structured as build_structured


def install_structured(ctx: BuildContext, so_far: Installed) -> FeatureInstall:
    config, mc = ctx.config, ctx.model_config
    structured = build_structured(config.structured, tokenizer=ctx.tokenizer, vocab_size=mc.vocab_size,
                                  stop_ids=mc.stop_token_ids, device=ctx.device,
                                  max_matchers=config.max_running + config.max_queued)
    hook = structured.hook
    if hook is None:
        return FeatureInstall(structured=structured)
    return FeatureInstall(hooks=[hook], pools=list(hook.pools), token_checks=[hook.check],
                          token_masks=structured.masks, structured=structured)

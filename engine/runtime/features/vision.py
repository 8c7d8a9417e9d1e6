"""Images: the embedding cache and the `multimodal` hook, and the runner's embedder."""

from __future__ import annotations

from engine.model.vision import make_embedder, projector
from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from resources.multimodal_cache import MultimodalCache, MultimodalHook


def install_vision(ctx: BuildContext, so_far: Installed) -> FeatureInstall | None:
    model, image_token = ctx.model, ctx.model_config.image_token_id
    if getattr(model, "vision_projector", None) is None or image_token is None:
        return None
    cache = MultimodalCache(ctx.config.mm_cache_bytes)
    hook = MultimodalHook(cache, projector(model))
    return FeatureInstall(hooks=[hook], pools=[cache], embedder=make_embedder(model, image_token, hook.embeddings),
                          mm_cache_bytes=ctx.config.mm_cache_bytes)

"""The vision side of multimodal inputs: placeholder expansion at intake and
embedding substitution in the forward pass.

Images are uint8 ``[H, W, 3]`` tensors. A prompt's image placeholder tokens
(the tokenizer's `image_token_id`) are expanded so each image gets one
placeholder per patch; a prompt without placeholders gets them prepended.
The embeddings themselves are cached and reference-counted by
`resources.multimodal_cache`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.errors import InvalidRequest
from states import Request


def prepare_images(model: Any, image_token_id: int | None, token_ids: list[int],
                   images: Sequence[Any]) -> list[int]:
    """Validate `images` and return the prompt with one placeholder per patch."""
    if image_token_id is None or getattr(model, "vision_projector", None) is None:
        raise InvalidRequest("mm_inputs", "empty: this model takes no images", list(images))
    vision = model.config.vision
    limit = (f"a uint8 [H, W, 3] torch tensor with H and W positive multiples of {vision.patch_size}"
             f" up to {vision.max_image_size}")
    counts = []
    for i, image in enumerate(images):
        if not isinstance(image, torch.Tensor):
            raise InvalidRequest(f"mm_inputs[{i}]", limit, type(image).__name__)
        try:
            counts.append(model.num_image_tokens(image))
        except ValueError:
            raise InvalidRequest(f"mm_inputs[{i}]", limit, f"{image.dtype} {list(image.shape)}") from None
    marks = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if not marks:
        return [image_token_id] * sum(counts) + token_ids
    if len(marks) != len(images):
        raise InvalidRequest("prompt", f"one image placeholder per image ({len(images)})", len(marks))
    out: list[int] = []
    images_iter = iter(counts)
    for t in token_ids:
        out.extend([image_token_id] * next(images_iter) if t == image_token_id else [t])
    return out


def projector(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's vision projector as a plain function (no autograd)."""

    @torch.inference_mode()
    def project(image: torch.Tensor) -> torch.Tensor:
        return model.vision_projector(image)

    return project


def make_embedder(model: Any, image_token_id: int,
                  embeddings_of: Callable[[Request], torch.Tensor | None]) -> Callable[..., torch.Tensor | None]:
    """The runner's `embedder`: token embeddings with image rows substituted, or
    None when no request in the batch has images (the common, fast path).
    `embeddings_of` is the multimodal hook's accessor."""

    def embed(seqs, ids: torch.Tensor) -> torch.Tensor | None:
        images = [embeddings_of(s.request) for s in seqs]
        if all(e is None for e in images):
            return None
        embeds = model.model.embed_tokens(ids)
        offset = 0
        for s, patches in zip(seqs, images, strict=True):
            if patches is not None and s.start < s.request.num_prompt_tokens:
                prompt = s.request.prompt_token_ids
                marks = [i for i, t in enumerate(prompt) if t == image_token_id]
                for row, pos in enumerate(marks):
                    if s.start <= pos < s.start + s.num_tokens:
                        embeds[offset + pos - s.start] = patches[row].to(embeds.dtype)
            offset += s.num_tokens
        return embeds

    return embed

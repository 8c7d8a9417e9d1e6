"""The vision side of multimodal inputs: placeholder expansion at intake and
embedding substitution in the forward pass.

Images are uint8 ``[H, W, 3]`` tensors. A prompt's image placeholder tokens
(the tokenizer's `image_token_id`) are expanded so each image gets one
placeholder per patch; a prompt without placeholders gets them prepended.
The embeddings themselves are cached and reference-counted by
`resources.multimodal_cache`; `VisionProjector` is the model's part that
computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import InvalidRequest
from engine.model.model_config import VisionConfig
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


class VisionProjector(nn.Module):
    """Cuts an RGB uint8 image ``[H, W, 3]`` into square patches (row-major),
    scales pixels to [0, 1] and projects each patch to one embedding."""

    def __init__(self, vision: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.vision = vision
        self.proj = nn.Linear(vision.patch_dim, hidden_size, bias=True)

    def num_image_tokens(self, image: Tensor) -> int:
        """Patches (= placeholder tokens) `image` needs; ValueError if it is
        not an acceptable image."""
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
            raise ValueError(f"an image must be a uint8 [H, W, 3] tensor, got {image.dtype} {list(image.shape)}")
        height, width, _ = image.shape
        patch, limit = self.vision.patch_size, self.vision.max_image_size
        if not (0 < height <= limit and 0 < width <= limit) or height % patch or width % patch:
            raise ValueError(f"image sides must be positive multiples of {patch} up to {limit}, got {height}x{width}")
        return (height // patch) * (width // patch)

    def forward(self, image: Tensor) -> Tensor:
        """``[num_patches, hidden_size]`` embeddings for `image`."""
        num_patches = self.num_image_tokens(image)
        patch = self.vision.patch_size
        height, width, _ = image.shape
        pixels = image.to(device=self.proj.weight.device, dtype=self.proj.weight.dtype) / 255.0
        patches = pixels.view(height // patch, patch, width // patch, patch, 3).permute(0, 2, 1, 3, 4)
        return self.proj(patches.reshape(num_patches, self.vision.patch_dim))

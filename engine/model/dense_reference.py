"""The correctness oracle: a plain full-recompute causal forward of one
sequence, no paging, no cache, nothing shared with `engine.model.attention` but
the `AttentionBackend` protocol.

The engine's paged forward (and its greedy output) must equal this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model.llama import LlamaModel


class DenseCausalAttention:
    """`AttentionBackend` for one whole sequence: causal SDPA over exactly
    the k/v it is given, KV heads repeated to match the query heads; a layer
    with a sliding window W (`layer_windows[layer_id]`) lets query i see keys
    i - W < j <= i only. With `kv_dtype`, k and v are first rounded through
    that dtype: what a KV cache stored in it (`EngineConfig.kv_cache_dtype`)
    gives back."""

    def __init__(self, layer_windows: Sequence[int | None] = (), kv_dtype: torch.dtype | None = None) -> None:
        self.layer_windows = tuple(layer_windows)
        self.kv_dtype = kv_dtype

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(q.dtype), v.to(self.kv_dtype).to(q.dtype)
        group = q.shape[1] // k.shape[1]
        q_heads = q.transpose(0, 1)  # [H, L, D]
        k_heads = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v_heads = v.repeat_interleave(group, dim=1).transpose(0, 1)
        window = self.layer_windows[layer_id] if layer_id < len(self.layer_windows) else None
        if window is None:
            out = F.scaled_dot_product_attention(q_heads, k_heads, v_heads, is_causal=True)
        else:
            pos = torch.arange(q.shape[0], device=q.device)
            distance = pos[:, None] - pos[None, :]
            mask = (distance >= 0) & (distance < window)
            out = F.scaled_dot_product_attention(q_heads, k_heads, v_heads, attn_mask=mask)
        return out.transpose(0, 1)


def dense_forward(model: LlamaModel, token_ids: Sequence[int] | Tensor, input_embeds: Tensor | None = None,
                  routing: list[Tensor] | None = None, kv_dtype: torch.dtype | None = None) -> Tensor:
    """Float32 logits ``[L, vocab]`` of `model` over the whole sequence
    `token_ids` (positions 0..L-1), recomputed from scratch; MoE routing is
    appended to `routing` when given; K/V rounded through `kv_dtype` when given."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device)
    positions = torch.arange(ids.shape[0], device=model.device)
    attention = DenseCausalAttention(model.config.layer_windows, kv_dtype)
    with torch.inference_mode():
        return model(ids, positions, attention, input_embeds, routing=routing)

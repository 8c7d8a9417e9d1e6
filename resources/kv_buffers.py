"""Per-layer K and V buffers backing the paged KV allocator.

Memory layout (one pair per layer)::

    k[layer]: [num_pages * page_size, num_kv_heads, head_dim]
    v[layer]: same shape

    token location = page_id * page_size + offset_in_page

Page 0 is reserved as the padding page: its locations are written by padded
rows and never read as real context, so the allocator never hands it out.
"""

from __future__ import annotations

import torch


class KVBuffers:
    """The K/V tensors of every layer, indexed by token location."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_tokens = num_pages * page_size
        shape = (self.num_tokens, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

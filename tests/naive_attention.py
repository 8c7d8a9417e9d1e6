"""The per-row reference of paged attention: for each new query, each head, a
float64 softmax over exactly the context positions it may see."""

from __future__ import annotations

import torch

from engine.model.attention import AttentionMetadata


def naive_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: AttentionMetadata,
                    window: int | None = None) -> torch.Tensor:
    """Float64 ``[T, H, D]``: query i of sequence b (at position kv_len - q_len + i)
    over its context's positions up to its own, the last `window` of them when
    given; `meta` gives the context by token locations (`kv_locs`)."""
    assert meta.kv_locs is not None
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_buf.shape[1]
    row = 0
    for b, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
        locs = meta.kv_locs[b, :kv_len]
        for i in range(q_len):
            pos = kv_len - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            keys, values = k_buf[locs[first : pos + 1]].double(), v_buf[locs[first : pos + 1]].double()
            for h in range(q.shape[1]):
                scores = keys[:, h // group] @ q[row, h].double() * q.shape[2] ** -0.5
                out[row, h] = torch.softmax(scores, 0) @ values[:, h // group]
            row += 1
    return out

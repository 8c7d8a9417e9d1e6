"""How a chunk travels: the messages both sides post, from each side's page runs.

A side that holds the KV in memory the link's data group can reach (host
memory over gloo, device memory over NCCL) sends from, or receives into,
its KV buffers directly: one message per layer, K or V, and run of
consecutive token locations (`Piece`). A side whose memory the group cannot
reach (CUDA KV over gloo), or whose runs are too short to be worth a message
each (`LinkSettings.direct_min_run_bytes`), goes through staging instead: it
gathers or scatters a chunk laid out ``[layers, 2 (K, V), tokens, heads,
dim]``, and takes any split of it. Each side tells the other its run
starts, or that it stages (None): the decode in the JOB frame, the prefill
in its RESULT. Both compute the same messages from the two (`chunk_pieces`):

- both stage: one message per chunk (the whole staging buffer);
- else: per chunk, per layer, K then V, the chunk's tokens cut at every
  run start of either side; each message is then contiguous on both sides
  (a view of a KV buffer, or a slice of a staging buffer).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from engine.disagg.link.wire import Chunk, KVLayout, ProtocolError

WHOLE = -1  # a Piece's layer when it is the whole chunk


@attrs.frozen
class Piece:
    """One message: tokens [start, start + count) of one layer's K (kv=0) or V (kv=1), or the whole
    chunk (layer WHOLE)."""

    layer: int
    kv: int
    start: int
    count: int
    nbytes: int


def host_locations(pages: npt.NDArray[np.int64], page_size: int, num_tokens: int) -> npt.NDArray[np.int64]:
    """Token i's location in the KV buffers, from the request's page ids in token order (host only)."""
    offsets = np.arange(page_size, dtype=np.int64)
    locs: npt.NDArray[np.int64] = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:num_tokens]
    return locs


def run_starts(locs: npt.NDArray[np.int64]) -> list[int]:
    """The token indices (> 0) where the locations stop being consecutive: the starts of the runs after
    the first."""
    starts: list[int] = (np.flatnonzero(np.diff(locs) != 1) + 1).tolist()
    return starts


def reaches(backend: str) -> str:
    """The device type whose memory a backend's data group sends from and receives into."""
    return "cuda" if backend == "nccl" else "cpu"


def worth_direct(layout: KVLayout, num_tokens: int, starts: Sequence[int], min_run_bytes: int) -> bool:
    """Whether runs this long are worth a message each: their mean bytes (of one layer's K) reach
    `min_run_bytes`; else staging's one copy is cheaper than the messages."""
    per_token = layout.bytes_per_token_layer // 2
    return num_tokens * per_token >= min_run_bytes * (len(starts) + 1)


def check_starts(starts: object, num_tokens: int, who: str) -> list[int] | None:
    """A peer's run starts, validated: None (it stages) or strictly increasing ints in (0, num_tokens)."""
    if starts is None:
        return None
    if not isinstance(starts, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in starts):
        raise ProtocolError(f"{who} run starts are not a list of integers")
    if any(not 0 < s < num_tokens for s in starts) or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ProtocolError(f"{who} run starts are not increasing within (0, {num_tokens})")
    return starts


def cuts(src: Sequence[int] | None, dst: Sequence[int] | None) -> list[int] | None:
    """Where messages are cut: every run start of either side; None when both sides stage."""
    if src is None and dst is None:
        return None
    return sorted(set(src or ()) | set(dst or ()))


def chunk_pieces(layout: KVLayout, chunk: Chunk, cut: list[int] | None) -> list[Piece]:
    """The messages of `chunk`, in sending order (see the module docstring)."""
    if cut is None:
        return [Piece(WHOLE, 0, chunk.start, chunk.count, chunk.nbytes)]
    end = chunk.start + chunk.count
    inner = cut[bisect.bisect_right(cut, chunk.start): bisect.bisect_left(cut, end)]
    bounds = [chunk.start, *inner, end]
    per_token = layout.bytes_per_token_layer // 2
    return [Piece(layer, kv, a, b - a, (b - a) * per_token)
            for layer in range(chunk.first_layer, chunk.first_layer + chunk.num_layers)
            for kv in (0, 1) for a, b in zip(bounds, bounds[1:])]


def staged_views(layout: KVLayout, chunk: Chunk, buf: torch.Tensor, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """Each piece's slice of a staging buffer holding `chunk` (contiguous: one layer's K or V, a token run)."""
    kv = buf.view(layout.dtype).view(layout.chunk_shape(chunk))
    return [kv.reshape(-1) if p.layer == WHOLE else
            kv[p.layer - chunk.first_layer, p.kv, p.start - chunk.start: p.start - chunk.start + p.count]
            for p in pieces]


def direct_views(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], locs: npt.NDArray[np.int64],
                 pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """Each piece's view of the KV buffers at host locations `locs` (a piece never crosses a run)."""
    views = []
    for p in pieces:
        first = int(locs[p.start])
        views.append((k if p.kv == 0 else v)[p.layer][first: first + p.count])
    return views

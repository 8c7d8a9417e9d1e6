"""The model runner: turns a scheduled batch into one forward pass and tokens.

It runs in a worker thread while the event loop stays responsive. It only
reads requests and the request -> token table; it never transitions a
request or touches a pool's bookkeeping (the loop does that after the step).

`NoComputeRunner` builds the same batch tensors from the same tables but
skips the forward pass and returns fixed tokens: the engine-overhead
benchmark and the soak use it to measure everything but the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.sampling import sample
from engine.runtime.scheduler import ScheduledSeq
from resources.kv_buffers import KVBuffers
from resources.request_slots import RequestSlots
from states import Request


AttentionFactory = Callable[[Sequence[ScheduledSeq], AttentionMetadata], Any]


@attrs.define
class StepOutput:
    """Tokens sampled for the sampling seqs (in batch order) and MoE routing."""

    tokens: list[int]
    #: per MoE layer, the routed expert ids [T, top_k] of the step's tokens
    routing: list[torch.Tensor] = attrs.field(factory=list)


@attrs.frozen
class StepTiming:
    """Where one step's time went (seconds): building the batch's tensors, and
    the forward pass with sampling (the model's own work)."""

    batch: int
    decode_only: bool
    prepare_s: float
    forward_s: float


def token_range(request: Request, start: int, end: int) -> list[int]:
    """Token ids [start, end) of the request's prompt followed by its output."""
    prompt = request.prompt_token_ids
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return request.output_token_ids[start - p : end - p]
    return prompt[start:] + request.output_token_ids[: end - p]


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv: KVBuffers,
        slots: RequestSlots,
        device: torch.device,
        *,
        slot_of: Callable[[Request], int | None],
        attention_factory: AttentionFactory | None = None,
        embedder: Callable[[Sequence[ScheduledSeq], torch.Tensor], torch.Tensor | None] | None = None,
        faults: Any = None,
    ) -> None:
        self.faults = faults
        self.model = model
        self.kv = kv
        self.slots = slots
        self.device = device
        #: the request's row of the token table; None for rows whose backend keeps their KV itself
        self.slot_of = slot_of
        self.embedder = embedder
        #: (seqs, metadata) -> AttentionBackend for one step
        self.attention_factory: AttentionFactory = attention_factory or PagedAttention.factory(kv)
        #: when a list, each step appends `StepTiming` (benchmarks read it; None: no timing at all)
        self.timings: list[StepTiming] | None = None

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input ids [T], positions [T] and attention metadata for the batch."""
        ids: list[int] = []
        positions: list[int] = []
        q_lens, kv_lens, slots = [], [], []
        for s in seqs:
            end = s.start + s.num_tokens
            ids.extend(token_range(s.request, s.start, end))
            positions.extend(range(s.start, end))
            q_lens.append(s.num_tokens)
            kv_lens.append(end)
            slots.append(self.slot_of(s.request))
        dev = self.device
        # NOTE: slot_of is None for rows whose backend keeps their KV itself (HiSparse
        # decode rows): their locations read as the padding page 0.
        no_slot = [slot is None for slot in slots] if None in slots else None
        if no_slot is not None:
            slots = [0 if slot is None else slot for slot in slots]
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        table = self.slots.req_to_token
        out_locs = table[slots_t.repeat_interleave(torch.tensor(q_lens, device=dev)), pos_t]
        width = max(kv_lens)
        kv_locs = table[slots_t, :width]
        lens_t = torch.tensor(kv_lens, dtype=torch.int64, device=dev)
        kv_locs = kv_locs.masked_fill(torch.arange(width, device=dev)[None, :] >= lens_t[:, None], 0)
        if no_slot is not None:
            no_slot_t = torch.tensor(no_slot, device=dev)
            out_locs = out_locs.masked_fill(no_slot_t.repeat_interleave(torch.tensor(q_lens, device=dev)), 0)
            kv_locs = kv_locs.masked_fill(no_slot_t[:, None], 0)
        meta = AttentionMetadata(out_locs=out_locs, q_lens=q_lens, kv_lens=kv_lens, kv_locs=kv_locs)
        return ids_t, pos_t, meta

    @torch.inference_mode()
    def step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        self._inject_faults(seqs)
        t0 = time.perf_counter() if self.timings is not None else 0.0
        ids, positions, meta = self.prepare(seqs)
        rows, params, out_pos = self._sampling_rows(seqs)
        embeds = self.embedder(seqs, ids) if self.embedder is not None else None
        attention = self.attention_factory(seqs, meta)
        t1 = time.perf_counter() if self.timings is not None else 0.0
        routing: list[torch.Tensor] = []
        logits = self.model(ids, positions, attention, embeds, output_rows=rows, routing=routing)
        tokens = sample(logits, params, out_pos) if params else []
        if self.timings is not None:
            self.timings.append(StepTiming(len(seqs), all(s.num_tokens == 1 for s in seqs), t1 - t0,
                                           time.perf_counter() - t1))
        return StepOutput(tokens, routing)

    def _inject_faults(self, seqs: Sequence[ScheduledSeq]) -> None:
        if self.faults is not None:
            self.faults.before_step([s.request.request_id for s in seqs])

    def _sampling_rows(self, seqs: Sequence[ScheduledSeq]):
        rows, params, out_pos, offset = [], [], [], 0
        for s in seqs:
            offset += s.num_tokens
            if s.samples:
                rows.append(offset - 1)
                params.append(s.request.params)
                out_pos.append(s.request.num_output_tokens)
        return torch.tensor(rows, dtype=torch.int64, device=self.device), params, out_pos


class NoComputeRunner(ModelRunner):
    """Same batch preparation, no forward pass: token = (position * 7 + 11) % 256."""

    def step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        self._inject_faults(seqs)
        self.prepare(seqs)
        return StepOutput([((s.start + s.num_tokens) * 7 + 11) % 256 for s in seqs if s.samples])

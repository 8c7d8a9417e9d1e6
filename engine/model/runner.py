"""The model runner: turns a scheduled batch into one forward pass and tokens.

It runs in a worker thread (or, for a small step, on the event loop's own
thread) while the event loop stays responsive. It only reads requests and the
request -> token table; it never transitions a request, writes its progress
or touches a pool's bookkeeping: the step's output (tokens, logprobs, MoE
routing, and the fences of copies the step started, such as HiSparse's host
backups) goes back to the runtime's step applier, which applies it after the
step.

A step, from the loop's `step(seqs)` call::

    host: one pass over the batch -> token ids, positions, slots (Python ints)
    device: 3 small tensors; new-token locations and the page table read
            from the request -> token table (no host sync)
    forward: the model, attention planned once for all layers, the LM head
             on the sampling rows only
    sample: greedy rows by one batched argmax; the tokens come back in the
            step's one host sync

The model's weights are packed once, at construction (`LlamaModel.pack`).
A decode-only step of a dense model on CUDA replays a captured CUDA graph
when the batch fits a captured size (`engine.model.decode_graphs`).

`NoComputeRunner` builds the same batch tensors from the same tables but
skips the forward pass and returns fixed tokens: the engine-overhead
benchmark and the soak use it to measure everything but the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import torch

from engine.model.attention import AttentionBackend, AttentionMetadata, PagedAttention, PagedFactory
from engine.model.batch import ScheduledSeq
from engine.model.llama import LlamaModel
from engine.model.sampling import sample, token_logprobs
from resources.kv_buffers import KVBuffers
from resources.paging import round_up
from resources.request_slots import RequestSlots
from states import Fence, Request, TokenLogprob

if TYPE_CHECKING:
    from engine.model.decode_graphs import DecodeGraphs
    from engine.testing import FaultInjector


#: (seqs, metadata) -> the attention backend of one step
AttentionFactory = Callable[[Sequence[ScheduledSeq], AttentionMetadata], AttentionBackend]


@runtime_checkable
class MakesFences(Protocol):
    """An attention backend whose step starts copies (HiSparse's host backups): it lists each
    copy's fence with its request, and the step's output carries them back to the loop."""

    @property
    def fences(self) -> Sequence[tuple[Request, Fence]]: ...


@attrs.define
class StepOutput:
    """Tokens sampled for the sampling seqs (in batch order), MoE routing, and the fences of
    the copies the step started (the step applier adds them through the machine)."""

    tokens: list[int]
    #: per MoE layer, the routed expert ids [T, top_k] of the step's tokens
    routing: list[torch.Tensor] = attrs.field(factory=list)
    #: aligned with `tokens`: the token's `TokenLogprob` where its request asked, else None
    logprobs: list[TokenLogprob | None] = attrs.field(factory=list)
    #: (request, fence) of every copy the step started that may still be in flight
    fences: Sequence[tuple[Request, Fence]] = ()


@attrs.frozen
class StepTiming:
    """Where one step's time went (seconds): building the batch's tensors, and
    the forward pass with sampling (the model's own work)."""

    batch: int
    decode_only: bool
    prepare_s: float
    forward_s: float


@attrs.frozen(eq=False)
class StepInputs:
    """A batch's tensors: token ids and positions ``[T]``, attention metadata,
    and the rows of T whose logits are sampled (None: every row, in order)."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None


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
        model: LlamaModel,
        kv: KVBuffers,
        slots: RequestSlots,
        device: torch.device,
        *,
        slot_of: Callable[[Request], int | None],
        attention_factory: AttentionFactory | None = None,
        embedder: Callable[[Sequence[ScheduledSeq], torch.Tensor], torch.Tensor | None] | None = None,
        faults: FaultInjector | None = None,
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
        pack = getattr(model, "pack", None)
        if pack is not None:
            pack()
        #: CUDA graphs of decode steps (`engine.model.decode_graphs`); None: every step eager
        self.graphs: DecodeGraphs | None = None
        factory = self.attention_factory
        if device.type == "cuda" and isinstance(factory, PagedFactory) and not getattr(model.config, "is_moe", True):
            from engine.model.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, kv, slots, device, slot_of=slot_of, max_batch=slots.capacity,
                                       layer_windows=factory.layer_windows)

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> StepInputs:
        """The batch's tensors, built in one pass over `seqs` and no host sync."""
        ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        slots: list[int | None] = []
        samples: list[int] = []
        decode_only = True
        offset = 0
        for s in seqs:
            request, start, n = s.request, s.start, s.num_tokens
            end = start + n
            if n == 1:
                prompt = request.prompt_token_ids
                ids.append(prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)])
                positions.append(start)
            else:
                decode_only = False
                ids.extend(token_range(request, start, end))
                positions.extend(range(start, end))
            q_lens.append(n)
            kv_lens.append(end)
            slots.append(self.slot_of(request))
            offset += n
            if s.samples:
                samples.append(offset - 1)
        dev = self.device
        # NOTE: slot_of is None for rows whose backend keeps their KV itself (HiSparse
        # decode rows): their locations read as the padding page 0.
        no_slot = [slot is None for slot in slots] if None in slots else None
        if no_slot is not None:
            slots = [0 if slot is None else slot for slot in slots]
        host = torch.tensor([ids, positions], dtype=torch.int64)
        ids_t, pos_t = host.to(dev, non_blocking=True).unbind(0)
        slots_t = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        table = self.slots.req_to_token
        token_slots = slots_t if decode_only else slots_t.repeat_interleave(torch.tensor(q_lens).to(dev))
        out_locs = table[token_slots, pos_t]
        # NOTE: the page table is read straight from the token table (locations are
        # page * page_size + offset); columns past a row's context may name any page
        # (stale entries), which attention masks out and only ever reads.
        ps = self.kv.page_size
        pages = table[slots_t, : round_up(max(kv_lens), ps) : ps]
        if ps > 1:
            pages = pages // ps
        if no_slot is not None:
            no_slot_t = torch.tensor(no_slot).to(dev)
            row_mask = no_slot_t if decode_only else no_slot_t.repeat_interleave(torch.tensor(q_lens).to(dev))
            out_locs = out_locs.masked_fill(row_mask, 0)
            pages = pages.masked_fill(no_slot_t[:, None], 0)
        meta = AttentionMetadata(out_locs=out_locs, q_lens=q_lens, kv_lens=kv_lens, kv_pages=pages, page_size=ps)
        every_row = len(samples) == offset
        sample_rows = None if every_row else torch.tensor(samples, dtype=torch.int64).to(dev)
        return StepInputs(ids_t, pos_t, meta, sample_rows)

    @torch.inference_mode()
    def step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        self._inject_faults(seqs)
        timed = self.timings is not None
        t0 = time.perf_counter() if timed else 0.0
        params = [s.request.params for s in seqs if s.samples]
        out_pos = [s.request.num_output_tokens for s in seqs if s.samples]
        wants_logprobs = any(p.logprobs is not None for p in params)
        if (self.graphs is not None and not wants_logprobs
                and (tokens := self.graphs.step(seqs, params, out_pos)) is not None):
            if timed:
                self._record(seqs, t0, t0)
            return StepOutput(tokens)
        inputs = self.prepare(seqs)
        embeds = self.embedder(seqs, inputs.ids) if self.embedder is not None else None
        attention = self.attention_factory(seqs, inputs.meta)
        t1 = time.perf_counter() if timed else 0.0
        routing: list[torch.Tensor] = []
        logits = self.model(inputs.ids, inputs.positions, attention, embeds, output_rows=inputs.sample_rows,
                            routing=routing)
        tokens = sample(logits, params, out_pos) if params else []
        logprobs = token_logprobs(logits, tokens, params) if wants_logprobs else []
        if timed:
            self._record(seqs, t0, t1)
        fences = attention.fences if isinstance(attention, MakesFences) else ()
        return StepOutput(tokens, routing, logprobs, fences)

    def _record(self, seqs: Sequence[ScheduledSeq], t0: float, t1: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        decode_only = all(s.num_tokens == 1 for s in seqs)
        assert self.timings is not None  # called only for timed steps
        self.timings.append(StepTiming(len(seqs), decode_only, t1 - t0, time.perf_counter() - t1))

    def _inject_faults(self, seqs: Sequence[ScheduledSeq]) -> None:
        if self.faults is not None:
            self.faults.before_step([s.request.request_id for s in seqs])


class NoComputeRunner(ModelRunner):
    """Same batch preparation, no forward pass: token = (position * 7 + 11) % 256."""

    def step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        self._inject_faults(seqs)
        self.prepare(seqs)
        return StepOutput([((s.start + s.num_tokens) * 7 + 11) % 256 for s in seqs if s.samples])

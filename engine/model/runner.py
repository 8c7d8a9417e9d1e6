"""The model runner: turns a scheduled batch into one forward pass and tokens.

It runs in a worker thread (or, for a small step, on the event loop's own
thread) while the event loop stays responsive. It only reads requests and the
request -> token table; it never transitions a request, writes its progress
or touches a pool's bookkeeping: the step's output (tokens, logprobs, MoE
routing, and the fences of copies the step started, such as HiSparse's host
backups) goes back to the runtime's step applier, which applies it after the
step.

A step, from the loop's `step(seqs)` call, in whatever thread runs it,
under the engine's device (`resources.device_io.on_device`)::

    host: one pass over the batch -> token ids, positions, slots, sampled
          rows, the sampler's fields, written into one pinned buffer
    upload: one asynchronous host-to-device copy (`engine.model.step_upload`);
            new-token locations and the page table read on the device from
            the request -> token table
    forward: the model, attention planned once for all layers, the LM head
             on the sampling rows only (or a CUDA graph's replay)
    sample: every sampled row at once on the device (`engine.model.sampling`),
            logprobs from the same logits; rows a grammar constrains take an
            allowed-token mask (`token_masks`, computed on the host once the
            forward is launched: on a device it runs meanwhile)
    read back: tokens, MoE routing and logprobs in one copy and one wait
               (`resources.device_io.read_back`), the step's only host sync

A plain decode step (every row one sampled token of a request with a slot,
the paged attention backend) builds the same tensors on a short path
(`engine.model.decode_inputs`): on the host, the new tokens' locations and
the page table are read from the token table there; the general layout is
for every other step.

The model's weights are packed once, at construction (`LlamaModel.pack`).
A decode-only step on CUDA replays the CUDA graph of its batch bucket
(`engine.model.decode_graphs`), captured when the runner is built, whatever
its sampling params or logprobs.

`NoComputeRunner` builds the same batch tensors from the same tables but
skips the forward pass and returns fixed tokens: the engine-overhead
benchmark and the soak use it to measure everything but the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from engine.model.attention import AttentionBackend, AttentionMetadata, PagedAttention, PagedFactory
from engine.model.batch import ScheduledSeq, row_tokens
from engine.model.decode_inputs import decode_inputs
from engine.model.llama import LlamaModel
from engine.model.prompt_logprobs import PromptEntries, PromptLogprobPlan
from engine.model.decode_graphs import FIELD_ROWS, DecodeGraphs
from engine.model.sampling import SamplingBatch, format_logprobs, logprob_tensors, sample_tokens
from engine.model.step_types import StepInputs, StepMasks, StepOutput, StepTiming, TokenMasks
from engine.model.step_upload import Sections, StepUpload
from resources.device_io import on_device, read_back
from resources.kv_buffers import KVBuffers
from resources.paging import round_up
from resources.request_slots import RequestSlots
from states import Request, TokenLogprob

if TYPE_CHECKING:
    from engine.testing import FaultInjector


#: (seqs, metadata) -> the attention backend of one step
AttentionFactory = Callable[[Sequence[ScheduledSeq], AttentionMetadata], AttentionBackend]


class StepExtension(Protocol):
    """A step that replaces the plain one for some batches (speculation); None: the plain step runs."""

    def step(self, runner: ModelRunner, seqs: Sequence[ScheduledSeq]) -> StepOutput | None: ...


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
        cuda_graphs: bool = True,
        extension: StepExtension | None = None,
        token_masks: TokenMasks | None = None,
    ) -> None:
        self.faults = faults
        #: speculative decoding's verify step (`engine.speculative.step`), or None
        self.extension = extension
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
        #: the step's inputs: one pinned host buffer, one copy
        self.upload = StepUpload(device)
        #: plain decode steps take `engine.model.decode_inputs`' short path (False: every step the
        #: general one; tests compare the two)
        self.short_decode = True
        self._inference_mode = torch.inference_mode()
        #: the token table as a host array when it lives on the host (the short path reads it there)
        table = slots.req_to_token
        self._host_table = table.numpy() if table.device.type == "cpu" else None
        pack = getattr(model, "pack", None)
        if pack is not None:
            with on_device(device):
                pack()
        #: allowed-token masks of the sampled rows (structured output, a feature's runner part); None: none
        self.token_masks = token_masks
        #: CUDA graphs of decode steps (`engine.model.decode_graphs`); None: every step eager
        self.graphs: DecodeGraphs | None = None
        factory = self.attention_factory
        if cuda_graphs and device.type == "cuda" and isinstance(factory, PagedFactory) \
                and _graph_safe(model, slots.capacity):
            self.graphs = DecodeGraphs(model, kv, slots, device, max_batch=slots.capacity,
                                       layer_windows=factory.layer_windows)
            with torch.inference_mode():
                self.graphs.capture_all()  # NOTE: now, before the engine starts any thread

    def prepare(self, seqs: Sequence[ScheduledSeq], batch: SamplingBatch | None = None,
                extra: Sequence[tuple[str, Sequence[int]]] = ()) -> StepInputs:
        """The batch's tensors, from one pass over `seqs`, one upload and no host sync
        (`extra`: named int sections uploaded with them, in `StepInputs.extra`)."""
        ids: list[int] = []
        starts: list[int] = []
        shifts: list[int] = []  # a row's first position less its first token's place in the step
        q_lens: list[int] = []
        kv_lens: list[int] = []
        slots: list[int] = []
        live: list[bool] = []
        samples: list[int] = []
        decode_only = True
        offset = 0
        for s in seqs:
            request, start, n = s.request, s.start, s.num_tokens
            end = start + n
            if n == 1 and not s.draft:
                prompt = request.prompt_token_ids
                ids.append(prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)])
            else:
                decode_only = False
                ids.extend(row_tokens(s))
            starts.append(start)
            shifts.append(start - offset)
            q_lens.append(n)
            kv_lens.append(end)
            # NOTE: slot_of is None for rows whose backend keeps their KV itself (HiSparse
            # decode rows): their locations read as the padding page 0.
            slot = self.slot_of(request)
            slots.append(0 if slot is None else slot)
            live.append(slot is not None)
            offset += n
            if s.samples:
                if s.draft:  # from the request's last token on (a verify row: it and each draft)
                    samples.extend(range(offset - min(n, len(s.draft) + 1), offset))
                else:
                    samples.append(offset - 1)
        every_row = len(samples) == offset
        all_live = all(live)
        layout = Sections()
        for name, words in (("ids", offset), ("positions", offset), ("slots", len(seqs))):
            layout.add(name, words)
        if not decode_only:
            layout.add("token_slots", offset)
        if not all_live:
            layout.add("live", len(seqs))
            if not decode_only:
                layout.add("token_live", offset)
        if not every_row:
            layout.add("samples", len(samples))
        fields = batch.fields if batch is not None else None
        if fields is not None:
            layout.add("fields", fields.size)
        for name, values in extra:
            layout.add(name, len(values))
        host = self.upload.start(layout.size)
        layout.write(host, "ids", ids)
        layout.write(host, "slots", slots)
        if not all_live:
            layout.write(host, "live", live)
        if decode_only:  # one token a row: the row's start
            layout.write(host, "positions", starts)
        else:  # per token (numpy, no Python per token): positions on from each row's start, its slot, its flag
            counts = np.array(q_lens, dtype=np.int64)
            layout.write_ranges(host, "positions", np.array(shifts, dtype=np.int64), counts)
            layout.write_repeated(host, "token_slots", layout.section(host, "slots"), counts)
            if not all_live:
                layout.write_repeated(host, "token_live", layout.section(host, "live"), counts)
        if not every_row:
            layout.write(host, "samples", samples)
        if fields is not None:
            layout.write(host, "fields", fields.reshape(-1))
        for name, values in extra:
            layout.write(host, name, values)
        dev = self.upload.send(layout.size)
        ids_t, pos_t, slots_t = layout.view(dev, "ids"), layout.view(dev, "positions"), layout.view(dev, "slots")
        token_slots = slots_t if decode_only else layout.view(dev, "token_slots")
        table = self.slots.req_to_token
        out_locs = table[token_slots, pos_t]
        # NOTE: the page table is read straight from the token table (locations are
        # page * page_size + offset); columns past a row's context may name any page
        # (stale entries), which attention masks out and only ever reads.
        ps = self.kv.page_size
        pages = table[slots_t, : round_up(max(kv_lens), ps) : ps]
        if ps > 1:
            pages = pages // ps
        if not all_live:
            live_t = layout.view(dev, "live")
            out_locs = out_locs * (live_t if decode_only else layout.view(dev, "token_live"))
            pages = pages * live_t[:, None]
        meta = AttentionMetadata(out_locs=out_locs, q_lens=q_lens, kv_lens=kv_lens, kv_pages=pages, page_size=ps)
        sample_rows = None if every_row else layout.view(dev, "samples")
        fields_t = None if fields is None else layout.view(dev, "fields").view(fields.shape)
        sections = {name: layout.view(dev, name) for name, _ in extra}
        return StepInputs(ids_t, pos_t, meta, sample_rows, fields_t, sections)

    def step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        self._inject_faults(seqs)
        # NOTE: one inference_mode object, entered once per step (the runner runs one step at a
        # time): building one per call, as the decorator does, costs tens of microseconds a step
        # with the caches cold after the forward; on_device is a no-op off CUDA, and skipped
        with self._inference_mode:
            if self.device.type != "cuda":
                return self._step(seqs)
            with on_device(self.device):
                return self._step(seqs)

    def _step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        if self.extension is not None:
            extended = self.extension.step(self, seqs)
            if extended is not None:
                return extended
        timed = self.timings is not None
        t0 = time.perf_counter() if timed else 0.0
        params = [s.request.params for s in seqs if s.samples]
        batch = SamplingBatch(params, [s.request.num_output_tokens for s in seqs if s.samples]) if params else None
        plan = PromptLogprobPlan.build(seqs)  # issue 21: None unless a prefill chunk asked
        masks = None
        if self.token_masks is not None and batch is not None:
            masks = self.token_masks.begin([s.request for s in seqs if s.samples], self.device,
                                           self.model.config.vocab_size)
        if (self.graphs is not None and batch is not None and len(batch) == len(seqs) and plan is None
                and masks is None):
            replayed = self._replay(seqs, batch)
            if replayed is not None:
                logits, greedy, stacked, fields = replayed
                out = self._finish(logits, batch, fields, stacked, greedy)
                if timed:
                    self._record(seqs, t0, t0)
                return out
        factory = self.attention_factory
        short = None
        if self.short_decode and plan is None and batch is not None and isinstance(factory, PagedFactory):
            short = decode_inputs(seqs, batch.fields, upload=self.upload, table=self.slots.req_to_token,
                                  host_table=self._host_table, kv=self.kv, slot_of=self.slot_of,
                                  layer_windows=factory.layer_windows, kernel=factory.decode_kernel)
        attention: AttentionBackend
        if short is not None:  # a plain decode step (engine.model.decode_inputs): every row sampled
            ids, positions, attention, fields = short
            sample_rows = None
        else:
            inputs = self.prepare(seqs, batch)
            ids, positions, sample_rows, fields = inputs.ids, inputs.positions, inputs.sample_rows, inputs.fields
            attention = factory(seqs, inputs.meta)
        embeds = self.embedder(seqs, ids) if self.embedder is not None else None
        t1 = time.perf_counter() if timed else 0.0
        routing: list[torch.Tensor] = []
        rows = sample_rows if plan is None else plan.output_rows(sample_rows, self.device)
        # greedy rows only, no logprobs, no mask: the verified bfloat16 head (engine.model.greedy_head)
        head = getattr(self.model, "verified_head", None)
        verified = (head is not None and batch is not None and batch.greedy and not batch.wants_logprobs
                    and masks is None and plan is None)
        logits = self.model(ids, positions, attention, embeds, output_rows=rows, routing=routing,
                            apply_head=not verified)
        greedy = None
        if verified:
            greedy = head.argmax(logits) if head is not None else None  # `logits`: the final hidden states
            logits = self.model.logits(logits) if greedy is None else logits
        prompt_logprobs: list[PromptEntries] = []
        if plan is not None:  # issue 21: read back on their own (one more sync, in such steps only)
            logits, prompt_logprobs = plan.split(logits, sample_rows, len(params))
        out = self._finish(logits, batch, fields, torch.stack(routing) if routing else None, greedy,
                           masks=masks() if masks is not None else None)
        out.prompt_logprobs = prompt_logprobs
        # NOTE: what `isinstance(attention, MakesFences)` checks, without a protocol check's cost every step
        fences = getattr(attention, "fences", None)
        if fences is not None:
            out.fences = fences
        if timed:
            self._record(seqs, t0, t1, decode_only=True if short is not None else None)
        return out

    def _replay(self, seqs: Sequence[ScheduledSeq], batch: SamplingBatch) -> tuple[Any, Any, Any, Any] | None:
        """A decode-only batch through its CUDA graph: the inputs in one upload straight into
        the graph's static buffer, then the replay. None: the batch does not fit a graph."""
        graphs = self.graphs
        assert graphs is not None
        ids, positions, slots = [], [], []
        for s in seqs:
            request = s.request
            slot = self.slot_of(request)
            if s.num_tokens != 1 or request.mm_inputs or slot is None:
                return None
            prompt = request.prompt_token_ids
            ids.append(prompt[s.start] if s.start < len(prompt) else request.output_token_ids[s.start - len(prompt)])
            positions.append(s.start)
            slots.append(slot)
        largest = graphs.largest
        if graphs.disabled or len(seqs) > largest:
            return None
        words = (4 + FIELD_ROWS) * largest if batch.fields is not None else 4 * largest
        host = self.upload.start(words)
        graphs.write_inputs(host, largest, ids, positions, slots)
        if batch.fields is not None:
            # the fields region is [6, largest]; this step's rows are its first columns
            host[4 * largest : words].reshape(FIELD_ROWS, largest)[:, : len(seqs)] = batch.fields
        self.upload.send(words, into=graphs.buffer)
        ran = graphs.run(len(seqs))
        if ran is None:
            return None
        logits, greedy, routing = ran
        fields = None if batch.fields is None else graphs.fields[:, : len(seqs)]
        return logits, greedy, routing, fields

    def _finish(self, logits: torch.Tensor, batch: SamplingBatch | None, fields: torch.Tensor | None,
                routing: torch.Tensor | None, greedy: torch.Tensor | None = None,
                masks: StepMasks | None = None) -> StepOutput:
        """Sample on the device, then read tokens, routing ([layers, T, top_k]) and logprobs
        back in one copy."""
        parts: list[torch.Tensor] = []
        tokens = None
        if batch is not None:
            allowed = None if masks is None else masks[0]
            tokens = (greedy if greedy is not None and batch.greedy and allowed is None
                      else sample_tokens(logits, batch, fields, allowed=allowed))
            parts.append(tokens)
            if batch.wants_logprobs:
                parts.extend(logprob_tensors(logits, tokens, batch, fields))
        if routing is not None:
            parts.append(routing)
        if not parts:
            return StepOutput([])
        host = read_back(parts)
        token_ids = host[0].tolist() if batch is not None else []
        for row in masks[1] if masks is not None else ():
            token_ids[row] = -1  # NOTE: nothing was allowed: no token (the loop ends the request)
        logprobs: list[TokenLogprob | None] = []
        if batch is not None and batch.wants_logprobs:
            logprobs = format_logprobs(batch, token_ids, *host[1:4])
        return StepOutput(token_ids, list(host[-1].unbind(0)) if routing is not None else [], logprobs)

    def _record(self, seqs: Sequence[ScheduledSeq], t0: float, t1: float, decode_only: bool | None = None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if decode_only is None:
            decode_only = all(s.num_tokens == 1 for s in seqs)
        assert self.timings is not None  # called only for timed steps
        self.timings.append(StepTiming(len(seqs), decode_only, t1 - t0, time.perf_counter() - t1))

    def _inject_faults(self, seqs: Sequence[ScheduledSeq]) -> None:
        if self.faults is not None:
            self.faults.before_step([s.request.request_id for s in seqs])


def _graph_safe(model: Any, max_batch: int) -> bool:
    """Whether a decode step of `model` (up to `max_batch` rows) can be captured: dense, or
    MoE whose expert matmuls need no host sync (`engine.model.moe.MoEFeedForward.sync_free`)."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_moe", False):
        return True
    from engine.model.moe import MoEFeedForward

    return all(m.sync_free(max_batch) for m in model.modules() if isinstance(m, MoEFeedForward))


class NoComputeRunner(ModelRunner):
    """Same batch preparation, no forward pass: token = (position * 7 + 11) % 256."""

    def step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        self._inject_faults(seqs)
        with on_device(self.device):
            self.prepare(seqs)
        return StepOutput([((s.start + s.num_tokens) * 7 + 11) % 256 for s in seqs if s.samples])

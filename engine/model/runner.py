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
the page table are read from the token table there; the general layout
(`engine.model.batch_inputs`) is for every other step. A decode run
(`run`, `engine.model.decode_run`) takes several plain decode steps back to
back; a greedy run uploads every step's inputs at its first
(`engine.model.run_inputs`).

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

import torch

from engine.model.attention import AttentionBackend, AttentionMetadata, PagedAttention, PagedFactory
from engine.model.batch import ScheduledSeq
from engine.model.batch_inputs import batch_inputs
from engine.model.decode_inputs import decode_inputs
from engine.model.decode_run import run_decode_steps
from engine.model.run_inputs import RunInputs
from engine.model.llama import LlamaModel
from engine.model.prompt_logprobs import PromptEntries, PromptLogprobPlan
from engine.model.decode_graphs import DecodeGraphs
from engine.model.sampling import SamplingBatch, format_logprobs, logprob_tensors, sample_tokens
from engine.model.step_types import StepInputs, StepMasks, StepOutput, StepTiming, TokenMasks
from engine.model.step_upload import StepUpload
from resources.device_io import on_device, read_back
from resources.kv_buffers import KVBuffers
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
        #: whether the last step was a plain decode step that the next one can follow without the
        #: loop (its inputs are the rows' sampled tokens: `engine.model.decode_run`)
        self.last_plain = False
        #: the sampler's description of a plain step, for the rest of its run when it has no fields
        self._run_batch: SamplingBatch | None = None
        #: a decode run's inputs uploaded at its first step (`engine.model.run_inputs`), and the
        #: tokens the last step sampled, on the device: the next step's ids
        self._run_inputs: RunInputs | None = None
        self._sampled: torch.Tensor | None = None
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
        (`extra`: named int sections uploaded with them, in `StepInputs.extra`):
        `engine.model.batch_inputs`, the general path of every step."""
        return batch_inputs(seqs, batch, extra, upload=self.upload, table=self.slots.req_to_token, kv=self.kv,
                            slot_of=self.slot_of)

    def step(self, seqs: Sequence[ScheduledSeq]) -> StepOutput:
        """One model step of `seqs`."""
        # NOTE: one inference_mode object, entered once per step (the runner runs one step at a
        # time): building one per call, as the decorator does, costs tens of microseconds a step
        # with the caches cold after the forward; on_device is a no-op off CUDA, and skipped
        with self._inference_mode:
            if self.device.type != "cuda":
                return self.step_in_scope(seqs)
            with on_device(self.device):
                return self.step_in_scope(seqs)

    def run(self, seqs: Sequence[ScheduledSeq], steps: int, stop: Callable[[], bool] | None = None) -> list[StepOutput]:
        """A decode run: up to `steps` steps of the plain decode batch `seqs` back to back
        (`engine.model.decode_run`; `stop`: asked before each later step), all in one inference-mode
        scope; each output in order."""
        with self._inference_mode:
            if self.device.type != "cuda":
                return run_decode_steps(self, seqs, steps, stop)
            with on_device(self.device):
                return run_decode_steps(self, seqs, steps, stop)

    def step_in_scope(self, seqs: Sequence[ScheduledSeq], next_ids: Sequence[int] | None = None, ahead: int = 0,
                      steps: int = 1) -> StepOutput:
        """`step` inside the scope its caller entered (inference mode, the device). Within a decode
        run: `steps`, at its first step, how many the run may take; at a later one, `next_ids` the
        rows' token ids (sampled by the step before, not yet applied) and `ahead` how many tokens
        each row's output is ahead of its request's."""
        self._inject_faults(seqs)
        return self._step(seqs, next_ids, ahead, steps)

    def _step(self, seqs: Sequence[ScheduledSeq], next_ids: Sequence[int] | None = None, ahead: int = 0,
              steps: int = 1) -> StepOutput:
        self.last_plain = False
        run = self._run_inputs if next_ids is not None else None
        self._run_inputs = None
        if self.extension is not None and next_ids is None:
            extended = self.extension.step(self, seqs)
            if extended is not None:
                return extended
        timed = self.timings is not None
        t0 = time.perf_counter() if timed else 0.0
        batch: SamplingBatch | None
        if next_ids is not None and self._run_batch is not None:  # a run's later step: the same rows
            batch, plan = self._run_batch, None
        else:
            params = [s.request.params for s in seqs if s.samples]
            # NOTE: a seeded row's draw is keyed by its output position, so a run's later steps count ahead
            batch = SamplingBatch(params, [s.request.num_output_tokens + ahead for s in seqs if s.samples]) \
                if params else None
            plan = PromptLogprobPlan.build(seqs) if next_ids is None else None  # issue 21: a prefill chunk's
        # NOTE: with no fields (greedy rows, logprobs for all or none) a run's steps share one description
        self._run_batch = batch if batch is not None and batch.fields is None else None
        masks = None
        if self.token_masks is not None and batch is not None and next_ids is None:  # a run stops at a mask
            masks = self.token_masks.begin([s.request for s in seqs if s.samples], self.device,
                                           self.model.config.vocab_size)
        if (self.graphs is not None and batch is not None and len(batch) == len(seqs) and plan is None
                and masks is None):
            replayed = self.graphs.replay(seqs, batch.fields, self.upload, self.slot_of, next_ids)
            if replayed is not None:
                logits, graph_greedy, stacked, fields = replayed
                out = self._finish(logits, batch, fields, stacked, graph_greedy)
                if timed:
                    self._record(seqs, t0, t0)
                self.last_plain = True
                return out
        factory = self.attention_factory
        short = None
        if run is not None:  # a run's later step: views of its first step's upload (engine.model.run_inputs)
            short = run.step(ahead, self._sampled)
            self._run_inputs = run
        elif self.short_decode and plan is None and batch is not None and isinstance(factory, PagedFactory):
            if steps > 1 and batch.fields is None:
                self._run_inputs = RunInputs.build(
                    seqs, steps, upload=self.upload, table=self.slots.req_to_token, host_table=self._host_table,
                    kv=self.kv, slot_of=self.slot_of, layer_windows=factory.layer_windows,
                    kernel=factory.decode_kernel)
                short = None if self._run_inputs is None else self._run_inputs.step(0)
            else:
                short = decode_inputs(seqs, batch.fields, upload=self.upload, table=self.slots.req_to_token,
                                      host_table=self._host_table, kv=self.kv, slot_of=self.slot_of,
                                      layer_windows=factory.layer_windows, kernel=factory.decode_kernel,
                                      next_ids=next_ids)
        if next_ids is not None and (short is None or masks is not None):
            raise RuntimeError("a decode run continued past a step that was not a plain decode step")
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
        greedy: torch.Tensor | None = None
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
        self.last_plain = short is not None and masks is None and not out.fences
        return out

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
            self._sampled = tokens
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
        now = time.perf_counter()
        self.timings.append(StepTiming(len(seqs), decode_only, t1 - t0, now - t1, now))

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

    def run(self, seqs: Sequence[ScheduledSeq], steps: int, stop: Callable[[], bool] | None = None) -> list[StepOutput]:
        return [self.step(seqs)]  # NOTE: a run of one: its plain step (the prefill role never decodes)

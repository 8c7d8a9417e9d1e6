"""A small draft model proposes; its KV is a resource like the target's.

The draft model (any checkpoint whose tokenizer is the target's; the
built-in tiny model is its own draft, for tests) keeps its own KV: the pool
``draft_kv_pages`` (prefix cache off), one page-table row per request slot
(the target's slot number), pages held by the `spec_draft_kv` hook::

    acquired on entering DECODING (no pages: the draft catches up lazily)
    extend   (machine.extend, before a verify step): pages for the drafts
    rollback (machine.rollback, after it): what lies past the accepted tokens
    released on every path out of DECODING (finish, abort, retraction, shutdown)

Each verify step, per speculating row, in the step's thread::

    catch up: the tokens the draft has no KV for yet, [valid, N), one chunk
              -> d_1 from the logits at N - 1
    then k - 1 single-token passes: d_i at position N + i - 1 -> d_{i+1}

Drafts are drawn with the request's own sampling params and noise keys of
their own (`DRAFT_SALT`); the draft's distributions q go to the verifier.
NOTE: the draft runner writes `DraftBlock.written` (how far its KV now
reaches, like the KV it writes); `rollback` turns it into `valid`, the
prefix the accepted tokens confirm.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from engine.config import EngineConfig
from engine.errors import InvalidConfig
from engine.model.attention import PagedAttention
from engine.model.native_kernels import kernels_for
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.runner import ModelRunner
from engine.model.sampling import KEY, SamplingBatch, filtered_probs, salted_keys, sample_tokens
from engine.model.batch import ScheduledSeq
from engine.speculative.proposers import Proposal, with_draft
from resources.contract import ResourceHook
from resources.device_io import on_device, read_back
from resources.kv_buffers import KVBuffers
from resources.kv_pool import KVPool
from resources.request_slots import RequestSlotHook
from states import Handle, Request, RequestState

S = RequestState
DRAFT_KV_PAGES = "draft_kv_pages"
#: the salt of the draft's own sampling noise (independent of the target's)
DRAFT_SALT = 0xD4AF7


@attrs.define(eq=False)
class DraftBlock:
    """The draft's KV of one request: its page-table row, the pages held, `valid` (leading
    tokens whose draft KV is right) and `written` (how far the draft runner wrote)."""

    slot: int
    row: np.ndarray
    num_pages: int = 0
    valid: int = 0
    written: int = 0


class DraftKVHook(ResourceHook):
    name = "spec_draft_kv"
    acquire_on = frozenset({S.DECODING})
    scope = frozenset({S.DECODING})
    pool = DRAFT_KV_PAGES
    after = ("kv",)

    def __init__(self, pool: KVPool) -> None:
        self.kv = pool

    def acquire(self, request: Request, into: RequestState) -> Handle:
        slot = RequestSlotHook.slot(request)
        return Handle(self.name, request.request_id, DraftBlock(slot, self.kv.page_table[slot]), amount=0)

    def extend(self, request: Request, handle: Handle, num_tokens: int) -> bool:
        """Pages for the draft's KV of `num_tokens` tokens; False if the pool is short."""
        block: DraftBlock = handle.payload
        need = self.kv.pages_for(num_tokens) - block.num_pages
        if need <= 0:
            return True
        n = block.num_pages
        if not self.kv.alloc_into(block.row[n : n + need]):
            return False
        self.kv.write_locations(block.slot, n, block.row[n : n + need])
        block.num_pages += need
        handle.amount += need
        return True

    def rollback(self, request: Request, handle: Handle, num_tokens: int) -> None:
        """The accepted tokens confirm the draft's KV up to the request's last token; the pages
        past `num_tokens` tokens are given back."""
        block: DraftBlock = handle.payload
        block.valid = min(block.written, num_tokens - 1)
        block.written = block.valid
        keep = self.kv.pages_for(num_tokens)
        if keep < block.num_pages:
            self.kv.allocator.free(block.row[keep : block.num_pages])
            handle.amount -= block.num_pages - keep
            block.num_pages = keep

    def release(self, request: Request, handle: Handle) -> None:
        block: DraftBlock = handle.payload
        if block.num_pages:
            self.kv.allocator.free(block.row[: block.num_pages])

    @staticmethod
    def block(request: Request) -> DraftBlock | None:
        handle = request.handles.get(DraftKVHook.name)
        return None if handle is None else handle.payload


class DraftModelProposer:
    """Proposes with the draft model (see the module docstring)."""

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size

    def propose(self, seqs: Sequence[ScheduledSeq]) -> Proposal:
        speculating = [s for s in seqs if s.draft_budget and s.samples and DraftKVHook.block(s.request) is not None]
        if not speculating:
            return Proposal(list(seqs))
        with on_device(self.runner.device):
            drafts, probs = self._draft(speculating)
        rows: list[ScheduledSeq] = []
        sampled_rows: list[torch.Tensor | None] = []
        for s in seqs:
            found = drafts.get(s.request)
            if found:
                s = with_draft(s, found)
            rows.append(s)
            if s.samples:
                sampled_rows.append(probs.get(s.request))
        return Proposal(rows, _stack(sampled_rows, self.vocab_size) if probs else None)

    def _draft(self, seqs: list[ScheduledSeq]) -> tuple[dict[Request, list[int]], dict[Request, torch.Tensor]]:
        runner = self.runner
        drafts: dict[Request, list[int]] = {s.request: [] for s in seqs}
        probs: dict[Request, list[torch.Tensor]] = {}
        budget = {s.request: s.draft_budget for s in seqs}
        # the first pass catches each row up from its valid draft KV to its last token
        rows = []
        for s in seqs:
            block = DraftKVHook.block(s.request)
            assert block is not None
            start = min(block.valid, s.request.num_tokens - 1)
            rows.append(ScheduledSeq(s.request, start, s.request.num_tokens - start, True))
        while rows:
            batch = SamplingBatch([s.request.params for s in rows],
                                  [s.request.num_output_tokens + len(drafts[s.request]) for s in rows])
            inputs = runner.prepare(rows, batch)
            fields = inputs.fields
            if fields is not None:
                fields = fields.clone()
                fields[KEY] = salted_keys(fields[KEY], DRAFT_SALT)
            attention = runner.attention_factory(rows, inputs.meta)
            logits = runner.model(inputs.ids, inputs.positions, attention, None, output_rows=inputs.sample_rows)
            tokens = sample_tokens(logits, batch, fields)
            if not batch.greedy:
                assert fields is not None
                q = filtered_probs(logits, batch, fields)
                q = q / q.sum(-1, keepdim=True)
                for i, s in enumerate(rows):
                    probs.setdefault(s.request, []).append(q[i])
            (host,) = read_back([tokens])
            following = []
            for s, token in zip(rows, host.tolist()):
                request = s.request
                block = DraftKVHook.block(request)
                assert block is not None
                block.written = s.start + s.num_tokens  # NOTE: see the module docstring
                drafts[request].append(token)
                if len(drafts[request]) < budget[request]:
                    position = request.num_tokens + len(drafts[request]) - 1
                    following.append(ScheduledSeq(request, position, 1, True, draft=(token,)))
            rows = following
        return drafts, {r: torch.stack(qs) for r, qs in probs.items()}


def _stack(rows: list[torch.Tensor | None], vocab: int) -> torch.Tensor:
    """[S, K, V]: each sampled row's draft distributions, zero-padded (rows without drafts too)."""
    width = max(q.shape[0] for q in rows if q is not None)
    like = next(q for q in rows if q is not None)
    out = torch.zeros((len(rows), width, vocab), dtype=like.dtype, device=like.device)
    for i, q in enumerate(rows):
        if q is not None:
            out[i, : q.shape[0]] = q
    return out


@attrs.frozen
class Draft:
    proposer: DraftModelProposer
    hook: DraftKVHook
    pool: KVPool


def build_draft(config: EngineConfig, *, model_config: ModelConfig, device: torch.device, max_context: int) -> Draft:
    """The draft model, its KV pool and hook, and the proposer (`config.speculative.draft_model`)."""
    spec = config.speculative
    assert spec is not None and spec.draft_model is not None  # a draft-model config
    dtype = model_config.torch_dtype
    if spec.draft_model == "tiny":
        draft_config = attrs.evolve(ModelConfig.tiny(), dtype=model_config.dtype)
        model = LlamaModel.from_seed(draft_config, config.seed, device=device)
    else:
        from engine.model.checkpoint import load_checkpoint

        model, draft_config, _ = load_checkpoint(spec.draft_model, device=device, dtype=dtype)
    if draft_config.vocab_size != model_config.vocab_size:
        raise InvalidConfig("SpeculativeConfig.draft_model",
                            f"a model with the target's vocabulary ({model_config.vocab_size} tokens)",
                            f"{spec.draft_model} ({draft_config.vocab_size} tokens)")
    pool = KVPool(num_pages=config.num_kv_pages, page_size=config.page_size, max_running=config.max_running,
                  max_context=max_context, device=device, prefix_cache=False)
    pool.name = DRAFT_KV_PAGES
    buffers = KVBuffers(num_layers=draft_config.num_layers, num_pages=config.num_kv_pages,
                        page_size=config.page_size, num_kv_heads=draft_config.num_kv_heads,
                        head_dim=draft_config.head_dim, dtype=draft_config.torch_dtype, device=device)
    runner = ModelRunner(model, buffers, pool.slots, device, slot_of=RequestSlotHook.slot,
                         attention_factory=PagedAttention.factory(
                             buffers, draft_config.layer_windows,
                             kernels_for(config.native_kernels, device, draft_config.torch_dtype)),
                         cuda_graphs=False)
    return Draft(DraftModelProposer(runner, model_config.vocab_size), DraftKVHook(pool), pool)

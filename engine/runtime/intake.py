"""Request intake: validation and tokenization, before anything is allocated.

`RequestIntake.build` turns one `Engine.generate` call into its requests
(one per sequence of `SamplingParams.n`) or raises `InvalidRequest` naming
the field and the limit. Besides each field's own limits it refuses what
could never be admitted (a prompt plus its output beyond `max_context`, which
the configuration keeps within the KV pool; images whose embeddings exceed
the multimodal cache; more sequences than the engine's inbox holds,
`max_queued`), so a request that passes can only ever wait, never wait
forever.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from engine.config import SamplingParams
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.tokenizer import Tokenizer
from engine.errors import InvalidRequest
from engine.runtime.submit_options import SubmitOptions
from states import Request, RequestKind, TokenLogprob

if TYPE_CHECKING:
    from engine.runtime.sessions import SessionManager


class RequestIntake:
    def __init__(self, *, tokenizer: Tokenizer, model: LlamaModel, model_config: ModelConfig, max_context: int,
                 mm_cache_bytes: int | None, is_live: Callable[[str], bool],
                 sessions: SessionManager | None = None, max_queued: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_queued = max_queued
        self.model = model
        self.model_config = model_config
        self.max_context = max_context
        self.mm_cache_bytes = mm_cache_bytes
        self._is_live = is_live
        self.sessions = sessions

    def build(self, prompt: str | Sequence[int], params: SamplingParams | None, request_id: str | None,
              mm_inputs: Sequence[Any] | None, kind: RequestKind,
              options: SubmitOptions | None = None) -> tuple[str, list[Request]]:
        """(user-facing request id, its requests) for one submission."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params", "a SamplingParams", params)
        if self.max_queued is not None and params.n > self.max_queued:  # its sequences are queued together
            raise InvalidRequest("SamplingParams.n", f"<= max_queued = {self.max_queued} (the engine queues a "
                                 "request's sequences together)", params.n)
        options = options if options is not None else SubmitOptions()
        # issue 21: a later turn's text continues the conversation: no BOS in its middle
        continues = options.session is not None and self.sessions is not None and self.sessions.has_context(
            options.session)
        token_ids = self._token_ids(prompt, special=not continues)
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequest("SamplingParams.stop_token_ids", f"token ids in [0, {vocab})", bad[0])
        options.check(vocab_size=vocab, n=params.n, images=self._images(mm_inputs))
        if options.session is not None:  # issue 21: a turn's prompt follows the conversation so far
            if self.sessions is None:
                raise InvalidRequest("session", "an open session (this engine has none)", options.session)
            token_ids = self.sessions.turn_prompt(options.session, token_ids, params.max_new_tokens)
        if options.resume_output_ids:  # issue 21: max_new_tokens is what is left of the budget
            params = attrs.evolve(params, max_new_tokens=len(options.resume_output_ids) + params.max_new_tokens)
        total = len(token_ids) + params.max_new_tokens
        if total > self.max_context:
            field = "prompt + resume_output_ids + max_new_tokens" if options.resume_output_ids else \
                "prompt + max_new_tokens"
            raise InvalidRequest(field, f"<= max_context = {self.max_context}", total)
        request_id = self._request_id(request_id)
        images = self._images(mm_inputs)
        if images:
            from engine.model.vision import prepare_images

            token_ids = prepare_images(self.model, self.model_config.image_token_id, token_ids, images)
            total = len(token_ids) + params.max_new_tokens
            if total > self.max_context:
                raise InvalidRequest("prompt + image tokens + max_new_tokens", f"<= max_context = {self.max_context}",
                                     total)
            self._check_embeddings_fit(images)
        # issue 21: a resumed request starts with the output it had (its logprobs unknown: None entries)
        resumed = list(options.resume_output_ids)
        unknown: list[TokenLogprob | None] = [None] * len(resumed) if params.logprobs is not None else []
        if params.n == 1:
            requests = [Request(request_id, token_ids, params, kind=kind, mm_inputs=images,
                                output_token_ids=resumed, output_logprobs=unknown)]
        else:
            requests = [Request(f"{request_id}/{i}", list(token_ids), _sequence_params(params, i), kind=kind,
                                mm_inputs=list(images), shares_prompt=not images, output_token_ids=list(resumed),
                                output_logprobs=list(unknown)) for i in range(params.n)]
        for request in requests:  # issue 21
            options.apply(request)
            if params.prompt_logprobs is not None:  # every prompt position's logits, computed here
                request.skip_prefix_match = request.local_prefill = True
        return request_id, requests

    # ------------------------------------------------------------ fields
    def _token_ids(self, prompt: object, *, special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt", "a non-empty string or token list", prompt)
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer can encode it
                raise InvalidRequest("prompt", "valid Unicode text (no lone surrogates)",
                                     f"{prompt[exc.start:exc.end]!r} at {exc.start}") from None
            token_ids = list(self.tokenizer.encode(prompt) if special else
                             self.tokenizer.encode(prompt, add_special_tokens=False))
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
        else:
            raise InvalidRequest("prompt", "a string or a list of token ids", prompt)
        if not token_ids:
            raise InvalidRequest("prompt", "non-empty", prompt)
        vocab = self.model_config.vocab_size
        # NOTE: plain ints in range (the common case) checked at C speed, about half the per-token
        # cost of the loop below, which names the first bad id (and takes int subclasses but bool)
        if set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and max(token_ids) < vocab:
            return token_ids
        bad = [t for t in token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequest("prompt", f"token ids in [0, {vocab})", bad[0])
        return token_ids

    def _request_id(self, request_id: object) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id", "a non-empty string", request_id)
        if self._is_live(request_id):
            raise InvalidRequest("request_id", "unique among requests in flight", request_id)
        return request_id

    @staticmethod
    def _images(mm_inputs: Any) -> list[Any]:
        if mm_inputs is not None and not isinstance(mm_inputs, (list, tuple)):
            raise InvalidRequest("mm_inputs", "a list of images", type(mm_inputs).__name__)
        return list(mm_inputs or ())

    def _check_embeddings_fit(self, images: list[Any]) -> None:
        """Every image's embeddings are referenced at once while the request runs."""
        if self.mm_cache_bytes is None:
            return
        per_token = self.model_config.hidden_size * self.model.dtype.itemsize
        need = sum(self.model.num_image_tokens(image) for image in images) * per_token
        if need > self.mm_cache_bytes:
            raise InvalidRequest("mm_inputs", f"images whose embeddings fit in mm_cache_bytes = {self.mm_cache_bytes}",
                                 f"{need} bytes")


def _sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of an n > 1 request: its own seed, so the sequences differ."""
    seed = None if params.seed is None else (params.seed + index) % 2**63
    return attrs.evolve(params, n=1, seed=seed)

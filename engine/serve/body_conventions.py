"""vLLM's and SGLang's spellings of fields kvlife knows, rewritten to kvlife's before a body is parsed.

    raw = openai_conventions(raw)                 # /v1/completions, /v1/chat/completions
    raw, model = sglang_generate(raw)             # /generate as SGLang takes it

- ``top_k: -1`` means "off" in vLLM and SGLang; kvlife's "off" is 0.
- SGLang's native ``/generate`` (as SGLang Model Gateway sends it): ``model`` (null, or the served
  model: another is a 404 like on /v1), ``sampling_params.sampling_seed`` (kvlife's ``seed``), and
  nulls for ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` meaning the default. SGLang's
  other fields (``return_text_in_logprobs``, ``log_metrics``, ``no_logs``, ...) then go through
  `engine.serve.field_policy` like any unknown field.

The input dict is not changed; a rewritten copy is returned.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest

_DEFAULT_WHEN_NULL = ("max_new_tokens", "temperature", "top_p", "top_k")


def openai_conventions(raw: dict[str, Any]) -> dict[str, Any]:
    """A /v1 body with vLLM's ``top_k: -1`` as kvlife's 0."""
    if raw.get("top_k") == -1 and not isinstance(raw.get("top_k"), bool):
        return {**raw, "top_k": 0}
    return raw


def sglang_generate(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A /generate body in kvlife's spelling, and the model it names (None: any)."""
    body = dict(raw)
    model = body.pop("model", None)
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model", "a string or null", model)
    params = body.get("sampling_params")
    if isinstance(params, dict):
        params = {k: v for k, v in params.items() if not (k in _DEFAULT_WHEN_NULL and v is None)}
        if params.get("top_k") == -1 and not isinstance(params["top_k"], bool):
            params["top_k"] = 0
        if "sampling_seed" in params:
            seed = params.pop("sampling_seed")
            if seed is not None and params.get("seed") not in (None, seed):
                raise InvalidRequest("sampling_params.sampling_seed", "equal to sampling_params.seed when both "
                                     "are given (they are the same field)", seed)
            if seed is not None:
                params["seed"] = seed
        body["sampling_params"] = params
    return body, model

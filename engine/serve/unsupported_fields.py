"""Request fields of vLLM's and SGLang's APIs that kvlife does not implement and whose silent loss
would change the answer: accepted only at their neutral value (or null), else a 400 naming them.

Every other field kvlife does not know is ignored with one warning per field name
(`engine.serve.field_policy`), as vLLM does, so bodies built for vLLM or SGLang, or re-serialized
by a router (SGLang Model Gateway adds ``no_stop_trim``, ``skip_special_tokens``,
``separate_reasoning``, ...), are served. A field a kvlife parser knows is never looked up here.

Checked against vLLM 0.33.0 (``vllm/entrypoints/openai/completion/protocol.py``,
``chat_completion/protocol.py``) and SGLang's ``SamplingParams``, ``GenerateReqInput`` and OpenAI
protocol (``python/sglang/srt/sampling/sampling_params.py``, ``managers/io_struct.py``,
``entrypoints/openai/protocol.py``). docs/http.md lists them for users.

    BODY["min_tokens"].allows(0)         # True: the neutral value
    SAMPLING_PARAMS["min_new_tokens"]    # /generate's sampling_params
"""

from __future__ import annotations

from typing import Any

import attrs


def _same_kind(value: Any, neutral: Any) -> bool:
    """True and 1 are different values here (JSON's true is not the number 1)."""
    return isinstance(value, bool) == isinstance(neutral, bool)


@attrs.frozen
class Unsupported:
    """A field kvlife does not implement: `neutral` values (null is always neutral) and what it does."""

    does: str
    neutral: tuple[Any, ...] = ()

    def allows(self, value: Any) -> bool:
        return value is None or any(_same_kind(value, n) and value == n for n in self.neutral)

    def limit(self) -> str:
        shown = " or ".join(repr(n) for n in self.neutral)
        return f"{shown + ' or ' if shown else ''}absent (not supported by this server: {self.does})"


_OFF = (False,)
_STRUCTURED = Unsupported("structured output (a constraint on the answer)")

#: top-level fields of /v1/completions, /v1/chat/completions and /generate bodies
BODY: dict[str, Unsupported] = {
    # vLLM sampling extensions
    "use_beam_search": Unsupported("beam search", _OFF),
    "length_penalty": Unsupported("a beam-search length penalty", (1.0,)),
    "min_p": Unsupported("min-p sampling", (0.0,)),
    "repetition_penalty": Unsupported("a repetition penalty", (1.0,)),
    "min_tokens": Unsupported("a minimum output length", (0,)),
    "include_stop_str_in_output": Unsupported("the stop string kept in the text", _OFF),
    "skip_special_tokens": Unsupported("special tokens shown in the text (they are always skipped)", (True,)),
    "spaces_between_special_tokens": Unsupported("the spacing of special tokens", (True,)),
    "truncate_prompt_tokens": Unsupported("prompt truncation"),
    "allowed_token_ids": Unsupported("a restricted vocabulary"),
    "bad_words": Unsupported("banned words", ([],)),
    "logits_processors": Unsupported("custom logits processors", ([],)),
    "vllm_xargs": Unsupported("custom logits-processor arguments", ({},)),
    "repetition_detection": Unsupported("repetition detection"),
    "thinking_token_budget": Unsupported("a thinking-token budget"),
    "watermarking": Unsupported("watermarking", _OFF),
    "prompt_logprobs": Unsupported("prompt logprobs"),
    "logprob_token_ids": Unsupported("logprobs of chosen token ids"),
    "prompt_embeds": Unsupported("prompt embeddings"),
    # chat prompt shaping (the rendered prompt would differ)
    "echo": Unsupported("the prompt echoed in the answer", _OFF),
    "continue_final_message": Unsupported("continuing the last assistant message", _OFF),
    "documents": Unsupported("documents rendered by the chat template", ([],)),
    "chat_template": Unsupported("a chat template sent with the request"),
    "reasoning_effort": Unsupported("a reasoning effort given to the chat template"),
    "include_reasoning": Unsupported("the reasoning text left out of the answer", (True,)),
    # structured output (the constraint would be lost)
    "response_format": Unsupported("structured output (a constraint on the answer)", ({"type": "text"},)),
    "structured_outputs": _STRUCTURED,
    "guided_json": _STRUCTURED,
    "guided_regex": _STRUCTURED,
    "guided_choice": _STRUCTURED,
    "guided_grammar": _STRUCTURED,
    "json_schema": _STRUCTURED,
    "regex": _STRUCTURED,
    "ebnf": _STRUCTURED,
    "structural_tag": _STRUCTURED,
    # answer contents a client asked for
    "return_tokens_as_token_ids": Unsupported("logprob tokens shown as token ids", _OFF),
    "return_token_ids": Unsupported("token ids in the answer", _OFF),
    "return_prompt_text": Unsupported("the prompt text in the answer", _OFF),
    "return_token_offsets": Unsupported("token offsets in the answer", _OFF),
    "return_hidden_states": Unsupported("hidden states in the answer", _OFF),
    "return_routed_experts": Unsupported("routed experts in the answer", _OFF),
    "return_logprob": Unsupported("logprobs in meta_info", _OFF),
    "return_bytes": Unsupported("output bytes in the answer", _OFF),
    "return_entropy": Unsupported("entropies in the answer", _OFF),
    "modalities": Unsupported("output modalities other than text", (["text"],)),
    "audio": Unsupported("audio output"),
    "web_search_options": Unsupported("web search"),
    "tools": Unsupported("tool calling (on /v1/chat/completions only)", ([],)),
    "functions": Unsupported("function calling (on /v1/chat/completions only)", ([],)),
    "tool_choice": Unsupported("tool calling (on /v1/chat/completions only)", ("none",)),
    # other models, other inputs, other engines' handoffs
    "lora_path": Unsupported("a LoRA adapter (the base model would answer)"),
    "lora_id": Unsupported("a LoRA adapter (the base model would answer)"),
    "session_params": Unsupported("SGLang's session continuation"),
    "custom_logit_processor": Unsupported("a custom logit processor"),
    "custom_params": Unsupported("custom sampling parameters", ({},)),
    "stop_regex": Unsupported("regex stop conditions", ([],)),
    "no_stop_trim": Unsupported("the stop string kept in the text", _OFF),
    "input_embeds": Unsupported("input embeddings"),
    "image_data": Unsupported("images on this route", ([],)),
    "video_data": Unsupported("video", ([],)),
    "audio_data": Unsupported("audio input", ([],)),
    "background": Unsupported("a background job", _OFF),
    "kv_transfer_params": Unsupported("vLLM's disaggregation handoff (see docs/disaggregation.md for kvlife's)"),
    "ec_transfer_params": Unsupported("vLLM's encoder-cache handoff"),
    "bootstrap_host": Unsupported("SGLang's disaggregation handoff (see docs/disaggregation.md for kvlife's)"),
    "bootstrap_port": Unsupported("SGLang's disaggregation handoff (see docs/disaggregation.md for kvlife's)"),
    "bootstrap_room": Unsupported("SGLang's disaggregation handoff (see docs/disaggregation.md for kvlife's)"),
}

#: fields of /generate's ``sampling_params`` (SGLang's SamplingParams, and vLLM's names for the same)
SAMPLING_PARAMS: dict[str, Unsupported] = {
    "min_p": BODY["min_p"],
    "frequency_penalty": Unsupported("a frequency penalty", (0.0,)),
    "presence_penalty": Unsupported("a presence penalty", (0.0,)),
    "repetition_penalty": BODY["repetition_penalty"],
    "min_new_tokens": Unsupported("a minimum output length", (0,)),
    "min_tokens": BODY["min_tokens"],
    "n": Unsupported("several sequences on /generate (use /v1/completions with n)", (1,)),
    "json_schema": _STRUCTURED,
    "regex": _STRUCTURED,
    "ebnf": _STRUCTURED,
    "structural_tag": _STRUCTURED,
    "skip_special_tokens": BODY["skip_special_tokens"],
    "spaces_between_special_tokens": BODY["spaces_between_special_tokens"],
    "no_stop_trim": BODY["no_stop_trim"],
    "include_stop_str_in_output": BODY["include_stop_str_in_output"],
    "stop_regex": BODY["stop_regex"],
    "custom_params": BODY["custom_params"],
    "logit_bias": Unsupported("a logit bias", ({},)),
    "use_beam_search": BODY["use_beam_search"],
    "bad_words": BODY["bad_words"],
    "allowed_token_ids": BODY["allowed_token_ids"],
}


def table_for(prefix: str) -> dict[str, Unsupported]:
    """The table that applies at a body location: the top level, ``sampling_params.``, or none
    (fields nested elsewhere, in messages or stream_options, are only ignored)."""
    if prefix == "":
        return BODY
    if prefix == "sampling_params.":
        return SAMPLING_PARAMS
    return {}

"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes (issue 21).

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"? (true), "return_token_strs"? (false)}
                   or {"model"?, "messages", "add_generation_prompt"? (true), "add_special_tokens"? (false*),
                       "chat_template_kwargs"?, "return_token_strs"?}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model"?, "tokens"} -> {"prompt"}

Messages are rendered with the model's chat template as `/v1/chat/completions`
renders them (*and, by default, encoded as it encodes them: adding no special
token for a checkpoint's own template, the tokenizer's own for the built-in
default). ``token_strs`` are the vocabulary's own token strings where the
tokenizer has them (a ``tokenizer.json``), else each token's decoded text.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.errors import InvalidRequest
from engine.serve.chat_schema import parse_messages
from engine.serve.chat_template import ChatTemplateError
from engine.serve.context import ServerContext
from engine.serve.http_errors import HTTPError
from engine.serve.schemas import known_fields, prompt_ids, served_model

_TEXT = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT = frozenset({"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs",
                   "chat_template_kwargs", "continue_final_message"})


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(name, "true or false", value)
    return value


def _tokenize(ctx: ServerContext, body: dict[str, Any]) -> list[int]:
    tokenizer = ctx.engine.tokenizer
    if "messages" in body:
        known_fields(body, _CHAT)
        if _flag(body, "continue_final_message", False):
            raise InvalidRequest("continue_final_message", "false or absent (not supported)", True)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise InvalidRequest("chat_template_kwargs", "a JSON object of template variables", kwargs)
        try:
            text = ctx.chat_template.render(parse_messages(body["messages"]),
                                            add_generation_prompt=_flag(body, "add_generation_prompt", True),
                                            extra=kwargs)
        except ChatTemplateError as exc:
            raise InvalidRequest("messages", "accepted by the model's chat template", str(exc)) from None
        # NOTE: by default as the chat route encodes it (a checkpoint's template writes its own BOS)
        default = ctx.chat_template.add_special_tokens
        return list(tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", default)))
    known_fields(body, _TEXT)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt", "a string (or give messages)", prompt)
    if len(prompt) > ctx.limits.max_context * 16:
        raise InvalidRequest("prompt", f"at most {ctx.limits.max_context * 16} characters", len(prompt))
    return list(tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True)))


def _token_str(tokenizer: Any, token_id: int) -> str:
    own = getattr(tokenizer, "id_to_token", None)
    return own(token_id) if own is not None else tokenizer.decode([token_id])


def token_routes(ctx: ServerContext) -> list[Route]:
    def check_model(body: dict[str, Any]) -> None:
        model = served_model(body, ctx.limits)
        if model != ctx.limits.model_name:
            raise HTTPError(404, f"model {model!r} is not served here (serving {ctx.limits.model_name!r})",
                            "model", repr(ctx.limits.model_name))

    async def tokenize(request: Request) -> Response:
        try:
            try:
                body = await ctx.read_json(request)
                check_model(body)
                tokens = _tokenize(ctx, body)
                strs = _flag(body, "return_token_strs", False)
            except InvalidRequest as exc:
                raise HTTPError.invalid(exc) from None
        except HTTPError as exc:
            return exc.response()
        tokenizer = ctx.engine.tokenizer
        return JSONResponse({"count": len(tokens), "max_model_len": ctx.limits.max_context, "tokens": tokens,
                             "token_strs": [_token_str(tokenizer, t) for t in tokens] if strs else None})

    async def detokenize(request: Request) -> Response:
        try:
            try:
                body = await ctx.read_json(request)
                known_fields(body, frozenset({"model", "tokens"}))
                check_model(body)
                tokens = prompt_ids(body.get("tokens"), "tokens", ctx.limits, ctx.engine.tokenizer) \
                    if body.get("tokens") != [] else []
            except InvalidRequest as exc:
                raise HTTPError.invalid(exc) from None
        except HTTPError as exc:
            return exc.response()
        return JSONResponse({"prompt": ctx.engine.tokenizer.decode(tokens)})

    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]

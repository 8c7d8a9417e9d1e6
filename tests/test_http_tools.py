"""Tool calling through the real `openai` client: "required" and a named function always give
arguments that parse and match the tool's schema, whole and streamed; "auto" reads each model
format end to end (the model's output forced into that format by a grammar); assistant tool calls
and tool messages go through the chat template as transformers renders them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import transformers

from engine.serve.server import ServerSettings
from http_helpers import serving, write_chat_checkpoint

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}"
    "{% if m.role == 'tool' %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def _client(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0,
                              timeout=20)


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list] = {}
    reason = None
    async for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
    return [(name, arguments) for name, arguments in calls.values()], reason


class TestConstrainedChoices:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                             {"type": "function", "function": {"name": "get_time"}}],
                             ids=["required", "named-weather", "named-time"])
    async def test_arguments_always_parse_and_match(self, tool_choice):
        """Seeded (n=3), whole and streamed: every call's arguments validate; finish tool_calls. (Seeded:
        "required" allows any number of calls, so an unseeded answer might run out of max_tokens.)"""
        async with serving() as (_, client):
            oa = _client(client)
            try:
                whole = await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, n=3, seed=9,
                                                         temperature=1.0, tool_choice=tool_choice, max_tokens=200)
                stream = await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=5,
                                                          tool_choice=tool_choice, max_tokens=200, stream=True)
                streamed, reason = await _streamed_calls(stream)
            finally:
                await oa.close()
        for choice in whole.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
            if isinstance(tool_choice, dict):
                assert [c.function.name for c in choice.message.tool_calls] == [tool_choice["function"]["name"]]
        _check_calls(streamed)
        assert reason == "tool_calls"

    @pytest.mark.asyncio
    async def test_no_parallel_calls_means_one(self):
        async with serving() as (_, client):
            oa = _client(client)
            try:
                answer = await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, n=4, seed=2,
                                                          temperature=1.0, tool_choice="required",
                                                          parallel_tool_calls=False, max_tokens=150)
            finally:
                await oa.close()
        assert all(len(c.message.tool_calls) == 1 for c in answer.choices)

    @pytest.mark.asyncio
    async def test_an_uncompilable_tool_schema_is_a_400_naming_tools(self):
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "wibble"}}}}}]
        async with serving() as (_, client):
            oa = _client(client)
            try:
                with pytest.raises(openai.BadRequestError) as refused:
                    await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=bad, tool_choice="required")
                ok = await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                      tool_choice="required", max_tokens=150)
            finally:
                await oa.close()
        assert refused.value.body["param"] == "tools"
        _check_calls([(c.function.name, c.function.arguments) for c in ok.choices[0].message.tool_calls])


#: parser -> a grammar forcing the tiny model's output into that parser's format (content, then a call)
ARGS = '%json {"type": "object", "additionalProperties": false, "required": ["zone"], ' \
       '"properties": {"zone": {"enum": ["UTC", "CET"]}}, "x-guidance": {"whitespace_flexible": false}}'
FORMATS = {
    "hermes": ('start: "Checking.\\n<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": " args '
               '"}\\n</tool_call>"\nargs: ' + ARGS, "Checking.\n"),
    "llama3_json": ('start: "{\\"name\\": \\"get_time\\", \\"parameters\\": " args "}"\nargs: ' + ARGS, None),
    "mistral": ('start: "Ok. [TOOL_CALLS] [{\\"name\\": \\"get_time\\", \\"arguments\\": " args "}]"\nargs: ' + ARGS,
                "Ok. "),
}


class TestAuto:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("parser", sorted(FORMATS))
    async def test_each_parser_end_to_end(self, parser):
        """The model writes its format (forced here by a grammar); whole and streamed answers carry
        the call with its arguments, the text around it as content."""
        grammar, content = FORMATS[parser]
        extra = {"structured_outputs": {"grammar": grammar}}
        async with serving(ServerSettings(tool_call_parser=parser)) as (_, client):
            oa = _client(client)
            try:
                whole = await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                         max_tokens=120, extra_body=extra, temperature=0)
                stream = await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                          max_tokens=120, extra_body=extra, stream=True,
                                                          temperature=0)
                streamed_content = ""
                calls: dict[int, list] = {}
                reason = None
                async for chunk in stream:
                    for choice in chunk.choices:
                        streamed_content += choice.delta.content or ""
                        reason = choice.finish_reason or reason
                        for call in choice.delta.tool_calls or ():
                            entry = calls.setdefault(call.index, ["", ""])
                            entry[0] += call.function.name or ""
                            entry[1] += call.function.arguments or ""
            finally:
                await oa.close()
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        assert reason == "tool_calls" and streamed_content == (content or "")
        assert [tuple(c) for c in calls.values()] == [("get_time", call.function.arguments)]

    @pytest.mark.asyncio
    async def test_plain_answers_stay_content(self):
        async with serving(ServerSettings(tool_call_parser="hermes")) as (_, client):
            oa = _client(client)
            try:
                answer = await oa.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=6,
                                                          temperature=0)
            finally:
                await oa.close()
        assert answer.choices[0].finish_reason == "length" and not answer.choices[0].message.tool_calls


@pytest.mark.asyncio
async def test_tool_turns_go_through_the_template_as_transformers_renders_them(tmp_path):
    """An assistant message with tool_calls and a tool message are accepted; the prompt (with the
    tools) is exactly transformers' rendering, arguments given to the template as objects."""
    checkpoint = write_chat_checkpoint(tmp_path / "ckpt", TOOL_TEMPLATE)
    arguments = {"city": "Paris", "days": 2}
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    as_transformers = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    expected = tokenizer.apply_chat_template(as_transformers, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    async with serving(model=str(checkpoint), max_context=1000) as (_, client):
        oa = _client(client)
        try:
            answer = await oa.chat.completions.create(model=str(checkpoint), messages=conversation, tools=TOOLS,
                                                      tool_choice="none", max_tokens=2)
        finally:
            await oa.close()
    assert answer.usage.prompt_tokens == len(expected)
    rendered = tokenizer.decode(expected)
    assert '<call>get_weather{"city": "Paris", "days": 2}</call>' in rendered and "(call_1)" in rendered

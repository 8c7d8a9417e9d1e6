"""The tool-call parsers and the chat answer's reading, on fixed model outputs: whole answers give
the calls (or leave malformed ones as content), streamed ones send names once complete and
arguments as written, and the streamed pieces add up to the whole answer."""

from __future__ import annotations

import json

import pytest

from engine.serve.chat_output import ChatChoices, ChatOutputSpec
from engine.serve.json_scan import scan_call, value_end
from engine.serve.tool_parsers import TOOL_PARSERS
from engine.serve.tools import Tool, ToolRequest

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" }{ brace"}
TIME = {"zone": "UTC"}
#: parser -> (model output, expected content, expected calls)
OUTPUTS = {
    "hermes": (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n'
               f'</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {json.dumps(TIME)}}}\n</tool_call>',
               "Let me check.\n"),
    "llama3_json": (f'{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}; '
                    f'{{"name": "get_time", "parameters": {json.dumps(TIME)}}}', None),
    "mistral": (f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}, '
                f'{{"name": "get_time", "arguments": {json.dumps(TIME)}}}]', "Sure. "),
}


def _spec(choice: str = "auto", parser: str | None = "hermes", reasoning: str | None = None) -> ChatOutputSpec:
    tools = (Tool("get_weather", {"type": "object"}), Tool("get_time", {"type": "object"}))
    request = ToolRequest(tools, choice, "get_time" if choice == "named" else None, True, [],
                          parser if choice == "auto" else None)
    return ChatOutputSpec(reasoning=reasoning, tools=request)


def _stream(spec: ChatOutputSpec, text: str, step: int = 3) -> tuple[list[dict], str | None]:
    """Feed `text` in pieces of `step` characters; (every delta, the finish reason)."""
    choices = ChatChoices(spec)
    deltas, reason = [], None
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        for choice in choices.chunk(0, piece, "stop" if last else None, None):
            deltas.append(choice["delta"])
            reason = choice["finish_reason"] or reason
    return deltas, reason


def _assemble(deltas: list[dict]) -> dict:
    """A whole message from streamed deltas, as an OpenAI client adds them up."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for delta in deltas:
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", ()):
            entry = message["tool_calls"].setdefault(call["index"], {"name": None, "arguments": "", "id": None})
            entry["id"] = call.get("id", entry["id"])
            function = call.get("function", {})
            entry["name"] = function.get("name", entry["name"])
            entry["arguments"] += function.get("arguments", "")
    return message


class TestJsonScan:
    @pytest.mark.parametrize("text,end", [('{"a": "}"}x', 10), ('[1, [2, 3]] ', 11), ('"x\\"y"', 6), ("12,", 2),
                                          ('{"a": [1', None), ('"abc', None), ("12", None)])
    def test_value_end(self, text, end):
        assert value_end(text, 0) == end

    def test_a_call_as_far_as_written(self):
        """The name once its string closes; the arguments' raw text as it grows."""
        assert scan_call('{"name": "f', 0).name is None
        partial = scan_call('{"name": "f", "arguments": {"x": [1, ', 0)
        assert partial.name == "f" and partial.arguments == '{"x": [1, ' and not partial.arguments_done
        whole = scan_call('{"arguments": {"x": 1}, "name": "g"}', 0)
        assert whole.complete and whole.name == "g" and json.loads(whole.arguments) == {"x": 1}
        assert not scan_call('{"name": 3}', 0).valid and not scan_call("[1]", 0).valid


class TestParsers:
    @pytest.mark.parametrize("parser", sorted(OUTPUTS))
    def test_whole_answer(self, parser):
        """Both calls, their arguments exactly the model's JSON, the content before the calls."""
        text, content = OUTPUTS[parser]
        message, reason = ChatChoices(_spec(parser=parser)).whole(0, text, "stop")
        assert reason == "tool_calls" and message["content"] == content
        calls = message["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [WEATHER, TIME]
        assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)

    @pytest.mark.parametrize("parser", sorted(OUTPUTS))
    @pytest.mark.parametrize("step", [1, 4, 17])
    def test_streamed_pieces_add_up_to_the_whole(self, parser, step):
        """Streamed in any piece size: names sent once, arguments as partial JSON, same result as whole."""
        text, content = OUTPUTS[parser]
        deltas, reason = _stream(_spec(parser=parser), text, step)
        message = _assemble(deltas)
        assert reason == "tool_calls" and message["content"] == (content or "")
        assert [c["name"] for c in message["tool_calls"].values()] == ["get_weather", "get_time"]
        assert [json.loads(c["arguments"]) for c in message["tool_calls"].values()] == [WEATHER, TIME]
        names = [call for d in deltas for call in d.get("tool_calls", ()) if "name" in call.get("function", {})]
        assert len(names) == 2  # each name once, in the call's first delta

    def test_mistral_without_its_marker(self):
        """[TOOL_CALLS] is a special token decoding drops: a bare array of calls is read as calls."""
        message, reason = ChatChoices(_spec(parser="mistral")).whole(0, ' [{"name": "get_time", "arguments": {}}]',
                                                                      "stop")
        assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_time"

    @pytest.mark.parametrize("parser,text", [("hermes", "Just text, no calls."), ("llama3_json", "Plain answer."),
                                             ("mistral", "No tools needed."),
                                             ("hermes", '<tool_call>{"name": "f", "arguments": {"x": </tool_call>')])
    def test_plain_or_malformed_output_stays_content(self, parser, text):
        message, reason = ChatChoices(_spec(parser=parser)).whole(0, text, "stop")
        assert reason == "stop" and message["content"] == text and "tool_calls" not in message

    def test_a_marker_prefix_is_held_back_while_streaming(self):
        """'<tool' might start a call: not sent as content until the text decides."""
        deltas, reason = _stream(_spec(), "Hi <tools are great", step=5)
        assert _assemble(deltas)["content"] == "Hi <tools are great" and reason == "stop"
        assert [d["content"] for d in deltas][:1] == ["Hi "]


class TestConstrainedModes:
    def test_named_function_takes_the_whole_answer_as_arguments(self):
        text = json.dumps(TIME)
        message, reason = ChatChoices(_spec("named")).whole(0, text, "stop")
        assert reason == "tool_calls" and message["content"] is None
        assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": text}
        deltas, _ = _stream(_spec("named"), text, 2)
        assert _assemble(deltas)["tool_calls"][0] == {"name": "get_time", "arguments": text,
                                                      "id": _assemble(deltas)["tool_calls"][0]["id"]}

    def test_required_reads_the_array_its_grammar_made(self):
        text = json.dumps([{"name": "get_weather", "arguments": WEATHER}, {"name": "get_time", "arguments": TIME}],
                          separators=(",", ":"))
        message, reason = ChatChoices(_spec("required")).whole(0, text, "stop")
        assert reason == "tool_calls" and [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] \
            == [WEATHER, TIME]
        assert ChatChoices(_spec("required")).whole(0, text[:-10], "length")[1] == "length"


class TestRequiredSchema:
    def test_the_grammar_lists_every_tool_and_bounds_parallel_calls(self):
        tools = (Tool("a", {"type": "object", "properties": {"x": {"type": "integer"}}}), Tool("b", {"type": "object"}))
        single = ToolRequest(tools, "required", None, False, []).constraint()
        schema = single.schema
        assert schema["minItems"] == 1 and schema["maxItems"] == 1
        assert [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]] == ["a", "b"]
        assert "maxItems" not in ToolRequest(tools, "required", None, True, []).constraint().schema
        assert ToolRequest(tools, "named", "a", True, []).constraint().schema == tools[0].parameters
        assert ToolRequest(tools, "auto", None, True, [], "hermes").constraint() is None

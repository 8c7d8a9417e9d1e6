"""The reasoning split on fixed outputs: where the output starts (from the prompt), the thinking
and the answer whole and streamed in any piece size, and tool calls read from the answer only."""

from __future__ import annotations

import json

import pytest

from engine.serve.chat_output import ChatChoices, ChatOutputSpec
from engine.serve.reasoning import ReasoningSplitter, initial_state
from engine.serve.tools import Tool, ToolRequest
from test_tool_parsers import _assemble, _stream


@pytest.mark.parametrize("parser,prompt,state", [
    ("deepseek_r1", "<|User|>hi<|Assistant|><think>\n", "reasoning"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "content"),
    ("qwen3", "<|im_start|>assistant\n", "auto"),
    ("deepseek_r1", "<|User|>hi<|Assistant|>", "reasoning"),
    ("qwen3", "old <think>a</think> turn<|im_start|>assistant\n", "auto"),
])
def test_where_the_output_starts(parser, prompt, state):
    assert initial_state(parser, prompt) == state


@pytest.mark.parametrize("state,text,thinking,answer", [
    ("auto", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("auto", "It is 4.", "", "It is 4."),
    ("reasoning", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("reasoning", "<think>Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("reasoning", "Still thinking <", "Still thinking <", ""),
    ("content", "<think>no</think>", "", "<think>no</think>"),
])
@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_split_whole_and_streamed(state, text, thinking, answer, step):
    """The pieces of any stream add up to the whole split; no piece shows part of a marker."""
    whole = ReasoningSplitter(state).feed(text, final=True)
    assert whole == (thinking, answer)
    splitter = ReasoningSplitter(state)
    got_thinking = got_answer = ""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        a, b = splitter.feed(piece, final=i == len(pieces) - 1)
        assert "</think" not in a and ("<think" not in b or state == "content")
        got_thinking, got_answer = got_thinking + a, got_answer + b
    assert (got_thinking, got_answer) == (thinking, answer)


def test_tool_calls_come_from_the_answer_only():
    """A call written inside the thinking is not a call; the one in the answer is, streamed or whole."""
    text = ('<think>maybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>?</think>'
            'Calling.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    tools = ToolRequest((Tool("get_time", {"type": "object"}),), "auto", None, True, [], "hermes")
    spec = ChatOutputSpec(reasoning="auto", tools=tools)
    message, reason = ChatChoices(spec).whole(0, text, "stop")
    assert reason == "tool_calls" and message["content"] == "Calling."
    assert message["reasoning_content"].startswith("maybe <tool_call>")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    deltas, streamed_reason = _stream(spec, text, 4)
    streamed = _assemble(deltas)
    assert streamed_reason == "tool_calls" and streamed["content"] == "Calling."
    assert streamed["reasoning_content"] == message["reasoning_content"]
    assert json.loads(streamed["tool_calls"][0]["arguments"]) == {"zone": "UTC"}

"""/v1/chat/completions with the real `openai` client: the prompt is the checkpoint's chat template
rendered as transformers renders it; streamed and whole answers, usage, refusals."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.serve.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from http_helpers import openai_client as _client
from http_helpers import serving, stream_events, transformers_chat_ids, write_chat_checkpoint

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

# Exercises what transformers gives a template: bos/eos strings, add_generation_prompt,
# raise_exception, namespace, tojson, loop controls, trim_blocks / lstrip_blocks.
TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system="") %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == (1 if ns.system else 0)) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[INST] {% if ns.system %}<<SYS>>{{ ns.system | tojson }}<</SYS>> {% endif %}{{ message['content'] | trim }} [/INST]
    {% else %}
 {{ message['content'] | trim }} {{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}Answer ({{ messages | length }} messages):{% endif %}"""

MESSAGES = [{"role": "system", "content": "Be brief & <kind>."}, {"role": "user", "content": "Hi there "},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Say é twice"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", TEMPLATE)




class TestTemplate:
    def test_renders_as_transformers(self, checkpoint):
        """The checkpoint's template, rendered and tokenized here, gives transformers' token ids exactly."""
        from engine.model.checkpoint import load_checkpoint

        template = ChatTemplate.for_model(str(checkpoint))
        _, _, tokenizer = load_checkpoint(checkpoint)
        ours = tokenizer.encode(template.render(MESSAGES, add_generation_prompt=True))
        assert template.origin.endswith("chat_template.jinja")
        assert ours == transformers_chat_ids(checkpoint, MESSAGES)

    def test_builtin_model_default_template(self):
        """The built-in tiny model renders role: content lines, then the assistant prompt."""
        template = ChatTemplate.for_model("tiny")
        assert template.source == DEFAULT_TEMPLATE
        assert template.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "


class TestChatWithTheOpenAIClient:
    @pytest.mark.asyncio
    async def test_whole_and_streamed(self, checkpoint):
        """Chat answers (whole and streamed) equal the engine's greedy output for transformers' prompt ids."""
        prompt_ids = transformers_chat_ids(checkpoint, MESSAGES)
        async with serving(model=str(checkpoint), max_context=512) as (engine, client):
            expected = await engine.complete(prompt_ids, SamplingParams(max_new_tokens=6))
            text = engine.tokenizer.decode(expected.token_ids)
            oa = _client(client)
            try:
                whole = await oa.chat.completions.create(model=str(checkpoint), messages=MESSAGES, max_tokens=6,
                                                         temperature=0)
                stream = await oa.chat.completions.create(model=str(checkpoint), messages=MESSAGES, max_tokens=6,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
                chunks = [chunk async for chunk in stream]
            finally:
                await oa.close()
        assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
        assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == text
        assert whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), 6)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(prompt_ids) + 6

    @pytest.mark.asyncio
    async def test_builtin_model_text_parts_and_max_completion_tokens(self):
        """Text content parts are joined; max_completion_tokens bounds the answer; the default template applies."""
        messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        async with serving() as (engine, client):
            expected = await engine.complete("user: a\nb\nassistant: ", SamplingParams(max_new_tokens=3))
            oa = _client(client)
            try:
                answer = await oa.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3,
                                                          temperature=0)
            finally:
                await oa.close()
        assert answer.choices[0].message.content == engine.tokenizer.decode(expected.token_ids)
        assert answer.usage.prompt_tokens == len("user: a\nb\nassistant: ")


class TestRefusals:
    @pytest.mark.asyncio
    @pytest.mark.parametrize(("body", "param"), [
        # "auto" (the default with tools) needs --tool-call-parser, which this server lacks
        ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "no spaces"}}]},
         "tools[0].function.name"),
        ({"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0]"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": MESSAGES, "n": 0}, "n"),
        ({"messages": MESSAGES, "logprobs": "yes"}, "logprobs"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": MESSAGES, "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"messages": [MESSAGES[1], MESSAGES[1]]}, "messages"),  # the template's raise_exception
        ({"messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ])
    async def test_refused_with_the_field(self, checkpoint, body, param):
        """Malformed tools and tool messages, images, bad n or logprobs, unknown response formats and what the
        template refuses are 400s naming the field."""
        async with serving(model=str(checkpoint), max_context=512) as (engine, client):
            response = await client.post("/v1/chat/completions", json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
        assert engine.stats.submitted == 0

    @pytest.mark.asyncio
    async def test_template_refusal_message(self, checkpoint):
        """The template's own raise_exception message reaches the client."""
        async with serving(model=str(checkpoint), max_context=512) as (_, client):
            events = await client.post("/v1/chat/completions", json={"messages": [MESSAGES[1], MESSAGES[1]]})
        assert "roles must alternate" in events.json()["error"]["message"]

    @pytest.mark.asyncio
    async def test_streamed_with_raw_sse(self):
        """The raw stream: a role chunk first, content deltas, a finish reason, then [DONE]."""
        async with serving() as (_, client):
            events = await stream_events(client, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "stream": True})
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"

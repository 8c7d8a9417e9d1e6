"""Constraints over HTTP as clients send them: OpenAI's response_format through the real `openai`
client, vLLM's structured_outputs and guided_* fields, SGLang's sampling_params; a grammar that
cannot be served is a 400 naming the field and the next request is served; /metrics counts it all."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from engine.serve.server import ServerSettings
from http_helpers import serving, stream_events, write_chat_checkpoint

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% endif %}")


def _client(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0,
                              timeout=20)


class TestOpenAI:
    @pytest.mark.asyncio
    async def test_response_format_json_schema_whole_and_streamed(self):
        """strict json_schema: whole, streamed and n=2 answers parse and validate."""
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        async with serving() as (_, client):
            oa = _client(client)
            try:
                whole = await oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, n=2,
                                                         temperature=1.0, seed=4, response_format=response_format)
                stream = await oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120,
                                                          response_format=response_format, stream=True)
                streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            finally:
                await oa.close()
        for text in [c.message.content for c in whole.choices] + [streamed]:
            jsonschema.validate(json.loads(text), PERSON)
        assert all(c.finish_reason == "stop" for c in whole.choices)

    @pytest.mark.asyncio
    async def test_json_object(self):
        async with serving() as (_, client):
            oa = _client(client)
            try:
                answer = await oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                                          response_format={"type": "json_object"}, temperature=0)
            finally:
                await oa.close()
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(answer.choices[0].message.content), dict)
        else:  # an object of unbounded size may run out of tokens: a prefix of one
            assert answer.choices[0].message.content.startswith("{")

    @pytest.mark.asyncio
    async def test_invalid_schema_is_a_400_naming_response_format_and_the_next_is_served(self):
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
        async with serving() as (engine, client):
            oa = _client(client)
            try:
                with pytest.raises(openai.BadRequestError) as refused:
                    await oa.chat.completions.create(model="tiny", messages=MESSAGES, response_format=bad)
                ok = await oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
            finally:
                await oa.close()
            assert engine.structured_stats.compiles.compile_failures == 1
        error = refused.value.body
        assert error["param"] == "response_format" and "frobnicate" in error["message"]
        assert ok.choices[0].finish_reason == "length"


class TestVLLMAndSGLangFields:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("extra,check", [
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ({"structured_outputs": {"json": json.dumps(PERSON)}}, lambda t: jsonschema.validate(json.loads(t), PERSON)
         is None),
        ({"structured_outputs": {"grammar": 'start: "x" NUM "y"\nNUM: /[0-9]{2}/'}},
         lambda t: re.fullmatch("x[0-9]{2}y", t)),
        ({"structured_outputs": {"grammar": 'root ::= "ab" [0-9] [0-9]'}}, lambda t: re.fullmatch("ab[0-9]{2}", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ], ids=["guided_regex", "guided_choice", "guided_json", "so-json", "so-lark", "so-gbnf", "so-choice"])
    async def test_completions_and_chat_take_vllms_fields(self, extra, check):
        """Each field constrains /v1/completions and /v1/chat/completions alike."""
        async with serving() as (_, client):
            completion = await client.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 120,
                                                                     "temperature": 0, **extra})
            chat = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 120, **extra})
        assert completion.status_code == chat.status_code == 200, (completion.text, chat.text)
        assert check(completion.json()["choices"][0]["text"])
        assert check(chat.json()["choices"][0]["message"]["content"])

    @pytest.mark.asyncio
    async def test_generate_takes_sglangs_fields(self):
        async with serving() as (_, client):
            answer = await client.post("/generate", json={"text": "Go:", "sampling_params": {
                "max_new_tokens": 120, "json_schema": json.dumps(PERSON)}})
            events = await stream_events(client, "/generate", {"text": "Go:", "stream": True, "sampling_params": {
                "max_new_tokens": 20, "regex": "[a-f]{6}"}})
        jsonschema.validate(json.loads(answer.json()["text"]), PERSON)
        assert re.fullmatch("[a-f]{6}", "".join(e["text"] for e in events[:-1]))

    @pytest.mark.asyncio
    @pytest.mark.parametrize("route,body,param", [
        ("/v1/chat/completions", {"messages": MESSAGES, "guided_regex": "a(b"}, "guided_regex"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "start: ("}},
         "structured_outputs.grammar"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "{bad"}}, "sampling_params.json_schema"),
        ("/generate", {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 2}}, "sampling_params.regex"),
    ])
    async def test_bad_constraints_are_400s_naming_the_field(self, route, body, param):
        async with serving() as (engine, client):
            response = await client.post(route, json=body)
            ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert ok.status_code == 200


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", QWEN3_TEMPLATE)


class TestReasoning:
    @pytest.mark.asyncio
    async def test_thinking_off_constrains_from_the_first_token(self, qwen3):
        """qwen3 with enable_thinking false: the prompt closes the thinking, the answer is all content
        and obeys response_format from its first token."""
        settings = ServerSettings(reasoning_parser="qwen3")
        async with serving(settings, model=str(qwen3), max_context=512) as (_, client):
            answer = await client.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 120, "chat_template_kwargs": {"enable_thinking": False},
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
        message = answer.json()["choices"][0]["message"]
        assert message["reasoning_content"] is None
        jsonschema.validate(json.loads(message["content"]), PERSON)

    @pytest.mark.asyncio
    async def test_open_thinking_streams_as_reasoning_and_is_not_constrained(self):
        """deepseek_r1: the output thinks until </think>; streamed as reasoning_content deltas, and the
        constraint waits for the answer (a model that never closes its thinking gets no JSON)."""
        settings = ServerSettings(reasoning_parser="deepseek_r1")
        body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "response_format": {"type": "json_object"}}
        async with serving(settings) as (_, client):
            whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
            events = await stream_events(client, "/v1/chat/completions", {**body, "stream": True})
            free = (await client.post("/v1/completions", json={"prompt": "user: Describe a person as JSON.\n"
                                                               "assistant: ", "max_tokens": 12,
                                                               "temperature": 0})).json()
        deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
        thinking = "".join(d.get("reasoning_content", "") for d in deltas)
        assert whole["finish_reason"] == "length" and whole["message"]["content"] == ""
        assert thinking == whole["message"]["reasoning_content"] == free["choices"][0]["text"]
        assert not any(d.get("content") for d in deltas)


@pytest.mark.asyncio
async def test_metrics_count_compiles_hits_requests_and_dead_ends():
    from engine import StructuredConfig

    dead = 'start: ' + " ".join(["s"] * 20) + '\ns: s s | "a"\n'
    async with serving(structured=StructuredConfig(step_max_items=500)) as (_, client):
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{8}"})
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8,
                                                   "structured_outputs": {"grammar": dead}})
        text = (await client.get("/metrics")).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kvlife:structured"))
    label = '{model_name="tiny"}'
    assert float(samples[f"kvlife:structured_compiles_total{label}"]) == 2
    assert float(samples[f"kvlife:structured_cache_hits_total{label}"]) == 1
    assert float(samples[f"kvlife:structured_requests_total{label}"]) == 3
    assert float(samples[f"kvlife:structured_dead_ends_total{label}"]) == 1
    assert float(samples[f"kvlife:structured_compile_seconds_count{label}"]) == 2

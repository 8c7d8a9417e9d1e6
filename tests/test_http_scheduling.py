"""Issue 21 over HTTP, through a real server and real clients: deadlines (body field and server default,
counted by reason in /metrics), priority, sessions, continuation, prompt logprobs and echo, /tokenize and
/detokenize in vLLM's shapes."""

from __future__ import annotations

import time

import anyio
import openai
import pytest

from engine import SamplingParams
from engine.serve.server import ServerSettings
from engine.testing import FaultInjector
from helpers import collect
from http_helpers import serving, stream_events

PROMPT = [11, 22, 33, 44, 55, 66, 77]


def _slow(seconds: float = 0.01) -> FaultInjector:
    return FaultInjector(stall_step=lambda ids: time.sleep(seconds))


def _client(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="none", max_retries=0)


class TestDeadlineAndPriority:
    @pytest.mark.asyncio
    async def test_deadline_field_and_metrics(self):
        """A body `deadline` that passes mid-answer: the OpenAI route answers the tokens so far with
        finish_reason "length" (OpenAI's truncation), /generate says "deadline"; /metrics counts both as
        deadline finishes."""
        async with serving(model="null", faults=_slow()) as (_, client):
            answer = (await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 200,
                                                                  "ignore_eos": True, "deadline": 0.1})).json()
            native = (await client.post("/generate", json={"input_ids": PROMPT, "deadline": 0.1, "sampling_params":
                                                           {"max_new_tokens": 200, "ignore_eos": True}})).json()
            metrics = (await client.get("/metrics")).text
        assert answer["choices"][0]["finish_reason"] == "length"
        assert 0 < answer["usage"]["completion_tokens"] < 200
        assert native["meta_info"]["finish_reason"] == "deadline" and 0 < len(native["output_ids"]) < 200
        assert 'kvlife:request_success_total{finished_reason="deadline",model_name="null"} 2.0' in metrics

    @pytest.mark.asyncio
    @pytest.mark.parametrize("stream", [False, True])
    async def test_a_deadline_before_the_first_token_is_a_408(self, stream):
        """A deadline that passes before any token (the request waits behind a slow one holding the only
        slot) is no empty success: the openai SDK raises a 408 `timeout` error, streamed or not."""
        async with serving(model="null", max_running=1, faults=_slow(0.2)) as (engine, client):
            filler = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True))
            while not engine.loop.num_running:  # the filler holds the one slot
                await anyio.sleep(0.005)
            oa = _client(client)
            try:
                with pytest.raises(openai.APIStatusError) as raised:
                    answer = await oa.completions.create(model="null", prompt=PROMPT, max_tokens=8, stream=stream,
                                                         extra_body={"deadline": 0.05},
                                                         extra_headers={"X-Request-Id": "late-1"})
                    if stream:
                        [chunk async for chunk in answer]
            finally:
                await oa.close()
            await collect(filler)
        assert raised.value.status_code == 408 and raised.value.type == "timeout", raised.value
        assert raised.value.response.headers["x-request-id"] == "late-1"  # an error answer names its request too
        assert engine.stats.finishes[("normal", "DEADLINE")] == 1

    @pytest.mark.asyncio
    async def test_server_default_deadline_and_override(self):
        """The server's default deadline applies when the body has none; a body deadline overrides it."""
        async with serving(ServerSettings(default_deadline=0.1), model="null", faults=_slow(0.005)) as (_, client):
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
            defaulted = (await client.post("/generate", json=body)).json()
            overridden = (await client.post("/generate", json=body | {"deadline": 60})).json()
        assert defaulted["meta_info"]["finish_reason"] == "deadline"
        assert overridden["meta_info"]["finish_reason"] == "length"

    @pytest.mark.asyncio
    async def test_priority_reaches_the_engine_and_bad_values_are_refused(self):
        """vLLM's `priority` field is the request's priority; a non-integer is a 400 naming it."""
        seen = {}
        async with serving() as (engine, client):
            engine.parts.machine.transition_observers.append(
                lambda r, src, dst: seen.setdefault(r.request_id, r.priority))
            oa = _client(client)
            try:
                await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"priority": -3})
                await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, extra_body={"priority": 7})
            finally:
                await oa.close()
            bad = {field: await client.post(route, json=body) for field, route, body in (
                ("priority", "/generate", {"input_ids": PROMPT, "priority": "high"}),
                ("deadline", "/v1/completions", {"prompt": PROMPT, "deadline": -1}),
                ("resume_output_ids", "/generate", {"input_ids": PROMPT, "resume_output_ids": [10**9]}),
                ("session_params.id", "/generate", {"input_ids": PROMPT, "session_params": {"id": 3}}),
            )}
            assert engine.stats.submitted == 2
        assert sorted(seen.values()) == [-3, 7]
        assert {field: (r.status_code, r.json()["error"]["param"]) for field, r in bad.items()} == {
            field: (400, field) for field in bad}


class TestSessions:
    @pytest.mark.asyncio
    async def test_turns_over_http(self):
        """Open, two turns (the second reuses the first's KV and equals the one-shot prompt), close."""
        params = {"max_new_tokens": 5, "ignore_eos": True}
        async with serving() as (_, client):
            opened = (await client.post("/open_session", json={"idle_timeout": 60})).json()
            sid = opened["session_id"]
            first = (await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": params,
                                                          "session_params": {"id": sid}})).json()
            second = (await client.post("/generate", json={"input_ids": [90, 91], "sampling_params": params,
                                                           "session_params": {"id": sid}})).json()
            one_shot = (await client.post("/generate", json={"input_ids": PROMPT + first["output_ids"] + [90, 91],
                                                             "sampling_params": params})).json()
            closed = await client.post("/close_session", json={"session_id": sid})
            again = await client.post("/close_session", json={"session_id": sid})
            gone = await client.post("/generate", json={"input_ids": [1], "session_params": {"id": sid}})
        assert opened["idle_timeout"] == 60
        assert second["output_ids"] == one_shot["output_ids"] and second["meta_info"]["cached_tokens"] >= 8
        assert closed.json() == {"session_id": sid, "closed": True} and again.status_code == 404
        assert gone.status_code == 400 and gone.json()["error"]["param"] == "session_params.id"

    @pytest.mark.asyncio
    async def test_one_turn_at_a_time_and_limits(self):
        """A second turn while one streams is a 400; max_sessions reached is a 503 with Retry-After."""
        async with serving(model="null", faults=_slow(), max_sessions=1) as (_, client):
            sid = (await client.post("/open_session", json={})).json()["session_id"]
            full = await client.post("/open_session", json={})
            async with client.stream("POST", "/generate", json={
                    "input_ids": PROMPT, "stream": True, "session_params": {"id": sid},
                    "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
                busy = await client.post("/generate", json={"input_ids": [1], "session_params": {"id": sid}})
            await client.post("/close_session", json={"session_id": sid})
        assert full.status_code == 503 and "Retry-After" in full.headers
        assert busy.status_code == 400 and "one turn at a time" in busy.json()["error"]["message"]


class TestContinuationAndLogprobs:
    @pytest.mark.asyncio
    async def test_resume_output_ids(self):
        """/generate continued from the first 4 tokens ends with the uninterrupted ids."""
        async with serving() as (_, client):
            sp = {"max_new_tokens": 12, "ignore_eos": True}
            whole = (await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})).json()
            resumed = (await client.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": sp | {"max_new_tokens": 8},
                "resume_output_ids": whole["output_ids"][:4]})).json()
        assert whole["output_ids"][:4] + resumed["output_ids"] == whole["output_ids"]

    @pytest.mark.asyncio
    async def test_prompt_logprobs_and_echo(self):
        """vLLM's prompt_logprobs and OpenAI's echo carry the engine's prompt logprobs (the first null)."""
        async with serving() as (engine, client):
            embedded = (await engine.complete(PROMPT, SamplingParams(max_new_tokens=1, prompt_logprobs=1)))
            expected = [None] + [e.logprob for e in embedded.prompt_logprobs[1:]]
            oa = _client(client)
            try:
                plain = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                                    extra_body={"prompt_logprobs": 1})
                echoed = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True,
                                                     logprobs=1, temperature=0)
                prompt_only = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                                          logprobs=1)
                chat = await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=1, extra_body={"prompt_logprobs": 0})
            finally:
                await oa.close()
            streamed = await stream_events(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                                       "echo": True, "stream": True})
        entries = plain.choices[0].model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(PROMPT)
        assert [None] + [entry[str(t)]["logprob"] for entry, t in zip(entries[1:], PROMPT[1:])] == expected
        text = engine.tokenizer.decode(PROMPT)
        assert echoed.choices[0].text.startswith(text) and len(echoed.choices[0].logprobs.tokens) == len(PROMPT) + 2
        assert echoed.choices[0].logprobs.token_logprobs[: len(PROMPT)] == expected
        assert echoed.choices[0].logprobs.top_logprobs[0] is None
        assert prompt_only.choices[0].text == text and prompt_only.usage.completion_tokens == 0
        assert prompt_only.choices[0].logprobs.token_logprobs == expected
        assert chat.model_extra["prompt_logprobs"][0] is None
        assert streamed[0]["choices"][0]["text"].startswith(text)


class TestTokenize:
    @pytest.mark.asyncio
    async def test_tokenize_and_detokenize_in_vllms_shapes(self):
        """/tokenize answers count, max_model_len, tokens, token_strs; /detokenize returns the prompt."""
        async with serving() as (engine, client):
            text = (await client.post("/tokenize", json={"prompt": "hello", "return_token_strs": True})).json()
            chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
            back = (await client.post("/detokenize", json={"tokens": text["tokens"]})).json()
            bad = await client.post("/tokenize", json={"prompt": "x", "add_special_tokens": "yes"})
            other = await client.post("/detokenize", json={"model": "other", "tokens": [1]})
        assert text == {"count": len(engine.tokenizer.encode("hello")), "max_model_len": engine.max_context,
                        "tokens": engine.tokenizer.encode("hello"),
                        "token_strs": [engine.tokenizer.decode([t]) for t in engine.tokenizer.encode("hello")]}
        assert chat["count"] == len(chat["tokens"]) > 0 and chat["token_strs"] is None
        assert back == {"prompt": "hello"}
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
        assert other.status_code == 404

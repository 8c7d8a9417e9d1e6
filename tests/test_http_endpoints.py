"""Every endpoint of the HTTP server, against a real uvicorn server on 127.0.0.1.

The autouse fixture in conftest.py checks every engine's pools after each test.
"""

from __future__ import annotations

import json
import time

import pytest

from engine import SamplingParams
from engine.testing import FaultInjector
from hisparse import HiSparseConfig
from engine.serve.settings import ServerSettings
from http_helpers import serving, stream_events

PROMPT = [5, 17, 42, 99, 3, 8, 120, 77, 31]


class TestGenerate:
    @pytest.mark.asyncio
    async def test_token_ids_match_the_embedded_api(self):
        """POST /generate returns what Engine.complete returns for the same prompt, with meta_info."""
        async with serving() as (engine, client):
            expected = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6))
            response = await client.post("/generate", json={"input_ids": PROMPT,
                                                            "sampling_params": {"max_new_tokens": 6}})
        assert response.status_code == 200
        body = response.json()
        assert body["output_ids"] == expected.token_ids
        assert body["text"] == engine.tokenizer.decode(expected.token_ids)
        meta = body["meta_info"]
        assert meta["finish_reason"] == "length" and meta["completion_tokens"] == 6
        assert meta["prompt_tokens"] == len(PROMPT) and meta["time_to_first_token"] <= meta["e2e_latency"]

    @pytest.mark.asyncio
    async def test_text_prompt_and_rid(self):
        """A text prompt is tokenized by the engine's tokenizer; a given rid is the request id."""
        async with serving() as (engine, client):
            expected = await engine.complete("hello", SamplingParams(max_new_tokens=3))
            response = await client.post("/generate", json={"text": "hello", "rid": "mine-1",
                                                            "sampling_params": {"max_new_tokens": 3}})
        assert response.json()["rid"] == "mine-1"
        assert response.json()["output_ids"] == expected.token_ids

    @pytest.mark.asyncio
    async def test_streaming_one_event_per_chunk(self):
        """Streaming sends one event per output chunk, a final one with the finish reason, then [DONE]."""
        async with serving() as (engine, client):
            expected = await engine.complete(PROMPT, SamplingParams(max_new_tokens=5))
            events = await stream_events(client, "/generate", {"input_ids": PROMPT, "stream": True,
                                                               "sampling_params": {"max_new_tokens": 5}})
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [c["finished"] for c in chunks] == [False] * 4 + [True]
        assert sum((c["token_ids"] for c in chunks), []) == expected.token_ids
        assert "".join(c["text"] for c in chunks) == chunks[-1]["output_text"]
        meta = chunks[-1]["meta_info"]
        assert meta["finish_reason"] == "length" and meta["completion_tokens"] == 5
        assert meta["time_to_first_token"] is not None and meta["e2e_latency"] > 0

    @pytest.mark.asyncio
    async def test_streamed_events_are_compact_json(self):
        """Each streamed event is byte for byte the compact JSON (ASCII-escaped, no spaces) of its payload:
        the per-token events are written from a template, which must escape the rid and text as json does."""
        rid = 'r"1\\\u00e9'
        async with serving() as (engine, client):
            body = {"text": "h\u00e9llo", "rid": rid, "stream": True, "sampling_params": {"max_new_tokens": 12}}
            async with client.stream("POST", "/generate", json=body) as response:
                lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 13
        payloads = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert all(p["rid"] == rid for p in payloads) and [p["finished"] for p in payloads] == [False] * 11 + [True]
        for line, payload in zip(lines, payloads):
            assert line == "data: " + json.dumps(payload, separators=(",", ":"))
        assert "".join(p["text"] for p in payloads) == payloads[-1]["output_text"]

    @pytest.mark.asyncio
    async def test_stream_interval(self):
        """With a stream interval of 3, a sequence's first token comes at once, then 3 tokens an event, the
        rest with the final event; the tokens and text are those of an event per output (/generate and /v1)."""
        async with serving(ServerSettings(stream_interval=3)) as (engine, client):
            expected = await engine.complete(PROMPT, SamplingParams(max_new_tokens=9))
            events = await stream_events(client, "/generate", {"input_ids": PROMPT, "stream": True,
                                                               "sampling_params": {"max_new_tokens": 9}})
            openai = await stream_events(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 9, "stream": True,
                                                                     "temperature": 0})
        chunks = events[:-1]
        assert [len(c["token_ids"]) for c in chunks] == [1, 3, 3, 2] and events[-1] == "[DONE]"
        assert sum((c["token_ids"] for c in chunks), []) == expected.token_ids == chunks[-1]["output_ids"]
        assert "".join(c["text"] for c in chunks) == chunks[-1]["output_text"] == engine.tokenizer.decode(
            expected.token_ids)
        assert len(openai) <= 5 and "".join(e["choices"][0]["text"] for e in openai[:-1]) == chunks[-1]["output_text"]

    @pytest.mark.asyncio
    async def test_stop_string(self):
        """A stop string cuts the text before it and finishes with 'stop'."""
        async with serving() as (engine, client):
            free = await engine.complete("abc", SamplingParams(max_new_tokens=12))
            text = engine.tokenizer.decode(free.token_ids)
            stop = next(c for c in text[2:] if c.isprintable() and c != "\ufffd")
            response = await client.post("/generate", json={"text": "abc", "sampling_params": {
                "max_new_tokens": 12, "stop": [stop]}})
        body = response.json()
        assert body["meta_info"]["finish_reason"] == "stop"
        assert body["text"] == text[: text.index(stop)]


class TestCompletions:
    @pytest.mark.asyncio
    async def test_completion_with_usage(self):
        """POST /v1/completions answers in OpenAI's shape, with usage."""
        async with serving() as (engine, client):
            expected = await engine.complete("hi", SamplingParams(max_new_tokens=4))
            response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                                   "max_tokens": 4, "temperature": 0})
        body = response.json()
        assert response.status_code == 200 and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == engine.tokenizer.decode(expected.token_ids)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}

    @pytest.mark.asyncio
    async def test_streaming_with_usage(self):
        """A streamed completion's deltas add up; include_usage adds a usage chunk before [DONE]."""
        async with serving() as (engine, client):
            expected = await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=6))
            events = await stream_events(client, "/v1/completions", {
                "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        choices = [e["choices"][0] for e in events[:-2]]
        assert "".join(c["text"] for c in choices) == engine.tokenizer.decode(expected.token_ids)
        assert choices[-1]["finish_reason"] == "length"
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6

    @pytest.mark.asyncio
    async def test_seeded_sampling_is_reproducible(self):
        """The same seed and temperature give the same completion."""
        body = {"prompt": "seed", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 7}
        async with serving() as (_, client):
            first = (await client.post("/v1/completions", json=body)).json()
            second = (await client.post("/v1/completions", json=body)).json()
        assert first["choices"][0]["text"] == second["choices"][0]["text"]

    @pytest.mark.asyncio
    async def test_unknown_model(self):
        """A model this server does not serve is a 404."""
        async with serving() as (_, client):
            response = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"

    @pytest.mark.asyncio
    async def test_models(self):
        """GET /v1/models lists the one served model."""
        async with serving() as (engine, client):
            body = (await client.get("/v1/models")).json()
        assert [m["id"] for m in body["data"]] == ["tiny"]
        assert body["data"][0]["max_model_len"] == engine.config.max_context


class TestAbort:
    @pytest.mark.asyncio
    async def test_abort_streaming_request(self):
        """POST /abort ends a running request with 'abort'; its stream gets the final event."""
        slow = FaultInjector(fail_step=lambda ids: time.sleep(0.01))
        async with serving(faults=slow) as (engine, client):
            async with client.stream("POST", "/generate", json={
                    "input_ids": PROMPT, "rid": "victim", "stream": True,
                    "sampling_params": {"max_new_tokens": 200}}) as response:
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                aborted = await client.post("/abort", json={"rid": "victim"})
                rest = [line async for line in lines if line.startswith("data: ")]
        assert aborted.status_code == 200 and aborted.json() == {"rid": "victim", "aborted": True}
        assert '"finish_reason":"abort"' in rest[-2] and rest[-1] == "data: [DONE]"
        assert engine.stats.finishes[("normal", "ABORT")] == 1

    @pytest.mark.asyncio
    async def test_abort_unknown(self):
        """Aborting an unknown or finished id is a 404."""
        async with serving() as (_, client):
            await client.post("/generate", json={"input_ids": PROMPT, "rid": "done",
                                                 "sampling_params": {"max_new_tokens": 1}})
            finished = await client.post("/abort", json={"rid": "done"})
            unknown = await client.post("/abort", json={"rid": "never-seen"})
        assert finished.status_code == 404 and unknown.status_code == 404


class TestHealth:
    @pytest.mark.asyncio
    async def test_liveness(self):
        """GET /health answers without making a request."""
        async with serving() as (engine, client):
            response = await client.get("/health")
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        assert engine.stats.submitted == 0

    @pytest.mark.asyncio
    async def test_health_generate(self):
        """GET /health_generate runs a health-check request through the whole path, then releases it."""
        async with serving() as (engine, client):
            response = await client.get("/health_generate")
            await engine.wait_idle(5)
        assert response.status_code == 200
        assert response.json()["status"] == "ok" and response.json()["checked"] == "request"
        assert engine.stats.finishes[("health_check", "LENGTH")] == 1
        assert engine.stats.transitions[("PREBUILT", "FINISHED")] == 1

    @pytest.mark.asyncio
    async def test_health_generate_failure_is_503_and_releases(self):
        """A health check that fails answers 503 with the reason; nothing leaks and the server still serves."""
        faults = FaultInjector(fail_step=lambda ids: any(i.startswith("health-") for i in ids))
        async with serving(faults=faults) as (engine, client):
            failed = await client.get("/health_generate")
            after = await client.post("/generate", json={"input_ids": PROMPT,
                                                         "sampling_params": {"max_new_tokens": 2}})
            await engine.wait_idle(5)
        assert failed.status_code == 503 and failed.json()["status"] == "unhealthy"
        assert failed.json()["reason"] == "failing" and "ERROR" in failed.json()["detail"]
        assert engine.stats.finishes[("health_check", "ERROR")] == 1 and after.status_code == 200

    @pytest.mark.asyncio
    async def test_health_generate_decode_role(self):
        """In the decode role the health check goes QUEUED -> TRANSFERRING -> PREBUILT -> FINISHED."""
        async with serving(disaggregation="decode") as (engine, client):
            response = await client.get("/health_generate")
            await engine.wait_idle(5)
        assert response.status_code == 200
        assert engine.stats.transitions[("QUEUED", "TRANSFERRING")] == 1
        assert engine.stats.transitions[("TRANSFERRING", "PREBUILT")] == 1
        assert engine.stats.finishes[("health_check", "LENGTH")] == 1

    @pytest.mark.asyncio
    async def test_health_generate_hisparse(self):
        """With HiSparse the health check finishes at its first token and HiSparse pools stay whole."""
        hisparse_config = HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=4)
        async with serving(hisparse=hisparse_config) as (engine, client):
            response = await client.get("/health_generate")
            await engine.wait_idle(5)
            memory = (await client.get("/debug/memory")).json()
        assert response.status_code == 200
        assert engine.stats.finishes[("health_check", "LENGTH")] == 1
        assert set(memory["pools"]) > {"kv_pages", "request_slots"}
        assert all(p["held"] == 0 and p["adds_up"] for p in memory["pools"].values())


class TestDebugMemory:
    @pytest.mark.asyncio
    async def test_owners_of_held_memory(self):
        """GET /debug/memory is memory_report() as JSON, naming the owner of held pages."""
        slow = FaultInjector(fail_step=lambda ids: time.sleep(0.01))
        async with serving(faults=slow) as (engine, client):
            async with client.stream("POST", "/generate", json={
                    "input_ids": PROMPT, "rid": "holder", "stream": True,
                    "sampling_params": {"max_new_tokens": 100}}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
                during = (await client.get("/debug/memory")).json()
                await client.post("/abort", json={"rid": "holder"})
            await engine.wait_idle(5)
            after = (await client.get("/debug/memory")).json()
        assert during["idle"] is False and during["pools"]["kv_pages"]["held"] > 0
        assert {o["request_id"] for o in during["owners"]["kv_pages"]} == {"holder"}
        assert after["idle"] is True and after["owners"] == {}
        assert all(p["held"] == 0 and p["adds_up"] for p in after["pools"].values())


class TestSockets:
    def test_accepted_connections_have_nodelay(self):
        """The listener sets TCP_NODELAY and accepted connections inherit it: a response written as head
        then body never waits for the client's delayed ACK (about 40 ms on Linux, per response)."""
        import socket

        from engine.serve.server import bind_socket

        listener = bind_socket("127.0.0.1", 0)
        try:
            listener.listen()
            with socket.create_connection(listener.getsockname()) as client:
                accepted, _ = listener.accept()
                with accepted:
                    assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                    assert client.fileno() >= 0
        finally:
            listener.close()

"""Failures look like failures to OpenAI clients (the real `openai` SDK): before the first token an HTTP error
in OpenAI's shape (503 + Retry-After for a failed transfer or a shutdown, 500 for an engine error), after it
an error event the SDK raises on; `/generate` keeps the precise finish reason in meta_info."""

from __future__ import annotations

import itertools

import anyio
import pytest

from engine import FinishReason, SamplingParams
from engine.testing import FaultInjector
from helpers import DEADLINE, StepGate, finish_as, live_request_ids
from http_helpers import openai_client as _client, parse_sse, serving

import openai  # noqa: E402 - in the test extra: a missing one fails, never skips

MESSAGES = [{"role": "user", "content": "hi"}]



def _fail_step_number(n: int):
    """A `fail_step` that fails the n-th model step (1-based) and no other."""
    calls = itertools.count(1)
    return lambda ids: next(calls) == n


async def _both_routes(oa: openai.AsyncOpenAI, *, stream: bool) -> list[Exception]:
    """A completion and a chat completion, whole or streamed (read to the end); what each raised."""
    raised = []
    for create in (lambda: oa.completions.create(model="tiny", prompt="hi", max_tokens=8,
                                                 stream=stream, extra_body={"ignore_eos": True}),
                   lambda: oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                                      stream=stream, extra_body={"ignore_eos": True})):
        try:
            answer = await create()
            if stream:
                [chunk async for chunk in answer]
        except openai.APIError as exc:
            raised.append(exc)
    return raised


class TestBeforeTheFirstToken:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("stream", [False, True])
    async def test_a_failed_transfer_is_503_with_retry_after(self, stream):
        """Decode role, every transfer fails: both routes answer 503 service_unavailable with Retry-After (a
        stream too: its response starts only with a token); /generate still says transfer_failed in meta_info."""
        faults = FaultInjector(fail_transfer=lambda request_id: True)
        async with serving(disaggregation="decode", faults=faults) as (engine, client):
            oa = _client(client)
            try:
                raised = await _both_routes(oa, stream=stream)
            finally:
                await oa.close()
            generate = await client.post("/generate", json={"text": "hi"})
        assert len(raised) == 2
        for exc in raised:
            assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503, exc
            assert exc.response.headers["retry-after"] == "1" and exc.type == "service_unavailable"
        meta = generate.json()["meta_info"]
        assert generate.status_code == 200 and meta["finish_reason"] == "transfer_failed" and meta["error"]
        assert engine.stats.finishes[("normal", "TRANSFER_FAILED")] == 3

    @pytest.mark.asyncio
    async def test_an_engine_error_is_500(self):
        """The first model step fails (ERROR, no token): a 500 server_error, whole and streamed."""
        async with serving(faults=FaultInjector(fail_step=lambda ids: True)) as (_, client):
            oa = _client(client)
            try:
                raised = await _both_routes(oa, stream=False) + await _both_routes(oa, stream=True)
            finally:
                await oa.close()
        assert len(raised) == 4
        assert all(isinstance(e, openai.InternalServerError) and e.status_code == 500 and e.type == "server_error"
                   and "retry-after" not in e.response.headers for e in raised)

    @pytest.mark.asyncio
    async def test_a_shutdown_is_503(self):
        """A request still queued when the server shuts down (finished SHUTDOWN, no token) is a 503 with
        Retry-After for the streaming SDK client, not an empty success."""
        gate = StepGate(match=lambda ids: "filler" in ids)
        async with serving(max_running=1, faults=FaultInjector(stall_step=gate)) as (engine, client):
            filler = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), request_id="filler")
            await gate.wait_entered()  # the one running slot is busy: the next request waits in the queue
            oa = _client(client)
            outcome: dict = {}

            async def chat() -> None:
                try:
                    await oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=True)
                except openai.APIError as exc:
                    outcome["raised"] = exc

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(chat)
                    with anyio.fail_after(DEADLINE):
                        while not (queued := [r for r in live_request_ids(engine) if r != "filler"]):
                            await anyio.sleep(0.01)
                    assert finish_as(engine, queued[0], FinishReason.SHUTDOWN)  # what leaving the engine does
                    gate.open()  # the loop applies the finish after the step in flight, before any admission
                [output async for output in filler]
            finally:
                await oa.close()
        exc = outcome["raised"]
        assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503, exc
        assert exc.response.headers["retry-after"] == "1" and "shutting down" in exc.message


class TestAfterTheFirstToken:
    @pytest.mark.asyncio
    async def test_a_stream_ends_with_an_error_event_the_sdk_raises(self):
        """The third model step fails: a stream already sent its first tokens, then an error event, which the
        SDK raises as APIError; the raw stream shows `data: {"error": ...}` then [DONE]."""
        async with serving(faults=FaultInjector(fail_step=_fail_step_number(3))) as (_, client):
            oa = _client(client)
            received: list = []
            try:
                stream = await oa.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True,
                                                          temperature=0, extra_body={"ignore_eos": True})
                with pytest.raises(openai.APIError) as raised:
                    async for chunk in stream:
                        received.append(chunk)
            finally:
                await oa.close()
        # tokens came first (greedy: sampled ones may be bytes of one character, held back as no text yet)
        assert any(c.choices and c.choices[0].delta.content for c in received)
        assert raised.value.type == "server_error" and "engine failed" in raised.value.message
        assert not any(c.choices and c.choices[0].finish_reason for c in received)

    @pytest.mark.asyncio
    async def test_raw_stream_and_whole_answer(self):
        """Raw SSE after a failure past the first token: the error event, then [DONE]; a whole answer that
        failed after tokens is the 500 itself (no partial success)."""
        async with serving(faults=FaultInjector(fail_step=_fail_step_number(3))) as (_, client):
            # NOTE: greedy: an unseeded sample draws from torch's global generator, whose state depends on
            # the tests run before; two sampled bytes can be half a character, and so no text yet
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "hi", "max_tokens": 8, "stream": True, "ignore_eos": True,
                    "temperature": 0}) as response:
                events = parse_sse([line async for line in response.aiter_lines()])
        async with serving(faults=FaultInjector(fail_step=_fail_step_number(3))) as (_, client):
            whole = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True})
        assert response.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2] == {"error": {"message": events[-2]["error"]["message"], "type": "server_error",
                                        "param": None, "code": 500, "limit": None}}
        assert any(e["choices"][0]["text"] for e in events[:-2])
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"

"""Bad input never reaches the engine: 400 naming the field and the limit, 413, 503 with Retry-After."""

from __future__ import annotations

import anyio
import pytest

from engine import InvalidRequest, SamplingParams
from engine.testing import FaultInjector
from engine.serve.server import ServerSettings
from http_helpers import StepGate, serving

PROMPT = [5, 17, 42, 99, 3]
OK = {"input_ids": PROMPT}

# (path, body (a dict, or raw bytes), the field the 400 must name)
BAD_BODIES = [
    ("/generate", b"{not json", "body"),
    ("/generate", b"[1, 2]", "body"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "body"),
    ("/generate", b"\xff\xfe", "body"),
    ("/generate", b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),  # past the decoder's nesting bound
    ("/generate", b'{"rid": ' + b"[" * 900 + b'"\\ud800"' + b"]" * 900 + b"}", "rid" + "[0]" * 900),
    ("/generate", {}, "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, "text"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [1, "a"]}, "input_ids"),
    ("/generate", {"input_ids": [1, True]}, "input_ids"),
    ("/generate", {"input_ids": [1, 10**9]}, "input_ids"),
    ("/generate", {"input_ids": [-1]}, "input_ids"),
    ("/generate", {"input_ids": [1] * 300}, "input_ids"),
    ("/generate", {**OK, "return_logprob": True}, "return_logprob"),
    ("/generate", {**OK, "model": 3}, "model"),
    ("/generate", {**OK, "sampling_params": {"min_new_tokens": 3}}, "sampling_params.min_new_tokens"),
    ("/generate", {**OK, "sampling_params": {"n": 2}}, "sampling_params.n"),
    ("/generate", {**OK, "sampling_params": {"sampling_seed": 3, "seed": 4}}, "sampling_params.sampling_seed"),
    ("/generate", {**OK, "sampling_params": [1]}, "sampling_params"),
    ("/generate", {**OK, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ("/generate", {**OK, "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
    ("/generate", {**OK, "sampling_params": {"max_new_tokens": 1000}}, "sampling_params.max_new_tokens"),
    ("/generate", {**OK, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {**OK, "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {**OK, "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ("/generate", {**OK, "sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
    ("/generate", {**OK, "sampling_params": {"seed": -3}}, "sampling_params.seed"),
    ("/generate", {**OK, "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids"),
    ("/generate", {**OK, "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ("/generate", {**OK, "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ("/generate", {**OK, "sampling_params": {"stop": ["a", "b", "c", "d", "e"]}}, "sampling_params.stop"),
    ("/generate", {**OK, "sampling_params": {"use_beam_search": True}}, "sampling_params.use_beam_search"),
    ("/generate", {**OK, "stream": "yes"}, "stream"),
    ("/generate", {**OK, "rid": ""}, "rid"),
    ("/generate", {**OK, "rid": 7}, "rid"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "model": 3}, "model"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "a", "functions": [{"name": "f"}]}, "functions"),
    ("/v1/completions", rb'{"prompt": "a\ud800"}', "prompt"),  # a lone surrogate: no encoder takes it
    ("/generate", rb'{"text": "\udc00"}', "text"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("/abort", {}, "rid"),
    ("/abort", {"rid": 5}, "rid"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "request_id": ""}, "request_id"),
]


class TestBadBodies:
    @pytest.mark.asyncio
    async def test_table_of_bad_bodies(self):
        """Each bad body is a 400 whose error names the field and the limit; the engine sees none."""
        async with serving() as (engine, client):
            for path, body, field in BAD_BODIES:
                if isinstance(body, bytes):
                    response = await client.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    response = await client.post(path, json=body)
                case = f"{path} {body!r}"
                assert response.status_code == 400, case
                error = response.json()["error"]
                assert error["param"] == field, case
                assert error["limit"] and field in error["message"], case
        assert engine.stats.submitted == 0

    @pytest.mark.asyncio
    async def test_limit_states_the_context_bound(self):
        """A prompt + max_new_tokens over max_context names max_context in the limit."""
        async with serving() as (_, client):
            response = await client.post("/generate", json={**OK, "sampling_params": {"max_new_tokens": 252}})
        assert "max_context" in response.json()["error"]["limit"]
        assert "251" in response.json()["error"]["limit"]

    @pytest.mark.asyncio
    async def test_duplicate_rid_in_flight(self):
        """A rid already in flight is a 400 on rid; the first request is unaffected."""
        gate = StepGate()
        async with serving(faults=FaultInjector(fail_step=gate)) as (engine, client):
            async with anyio.create_task_group() as tg:
                first = {}

                async def run_first() -> None:
                    first["response"] = await client.post("/generate", json={**OK, "rid": "dup"})

                tg.start_soon(run_first)
                await gate.wait_entered()
                second = await client.post("/generate", json={**OK, "rid": "dup"})
                gate.open()
        assert second.status_code == 400 and second.json()["error"]["param"] == "rid"
        assert first["response"].status_code == 200
        assert engine.stats.submitted == 1


#: Values of every JSON type, the edges of each, and text no encoder takes.
ODD_VALUES = [None, True, -1, 2**64, 1.5, "x", "\ud800", [None], [["x"]], {"a": None}]
#: Each route's base body and the fields (dotted into objects, [i] into lists) that get each odd value in turn.
FUZZED = [
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
     ["text", "input_ids", "input_ids[0]", "sampling_params", "stream", "rid", "extra",
      *(f"sampling_params.{f}" for f in ("max_new_tokens", "temperature", "top_p", "top_k", "stop",
                                         "stop_token_ids", "ignore_eos", "seed"))]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1},
     ["prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "n", "best_of",
      "logprobs", "echo", "suffix", "logit_bias", "presence_penalty", "user", "stop_token_ids", "ignore_eos",
      "stream_options", "stream_options.include_usage"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
     ["messages", "messages[0]", "messages[0].role", "messages[0].content", "messages[0].name",
      "messages[0].content[0]", "max_completion_tokens", "logprobs", "top_logprobs", "n", "tools", "tool_choice",
      "response_format", "add_generation_prompt", "chat_template_kwargs", "stream", "stop"]),
    ("/abort", {"rid": "nope"}, ["rid"]),
]


def _with(body: dict, path: str, value):
    """`body` with the value at `path` (a.b[0].c) replaced, creating the last step if it is missing."""
    import copy
    import re

    body = copy.deepcopy(body)
    steps = [int(s) if s.isdigit() else s for s in re.findall(r"[^.\[\]]+", path)]
    node = body
    for step in steps[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(step, {})
        elif isinstance(step, int) and isinstance(node, list) and step < len(node):
            node = node[step]
        else:
            return body
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(steps[-1], int) and steps[-1] < len(node)):
        node[steps[-1]] = value
    return body


class TestNoServerErrors:
    @pytest.mark.asyncio
    async def test_no_body_gets_a_500(self):
        """Every route, every field, every odd value (each JSON type, edges, lone surrogates): never a 5xx;
        a 400 names a field."""
        import json

        from engine import configure_logging

        configure_logging("warning")  # NOTE: ~500 requests; their debug lines would take most of the time
        async with serving(model="null") as (_, client):
            for path, base, fields in FUZZED:
                for field in fields:
                    for value in ODD_VALUES:
                        raw = json.dumps(_with(base, field, value)).encode()  # ASCII: surrogates stay escaped
                        response = await client.post(path, content=raw, headers={"content-type": "application/json"})
                        case = f"{path} {raw!r}"
                        assert response.status_code < 500, (case, response.text)
                        if response.status_code == 400:
                            assert response.json()["error"]["param"], case


class TestBounds:
    @pytest.mark.asyncio
    async def test_body_over_the_bound(self):
        """A body larger than max_body_bytes is a 413, declared or chunked."""

        async def chunked():
            yield b'{"text": "'
            yield b"a" * 3000
            yield b'"}'

        async with serving(ServerSettings(max_body_bytes=1000)) as (engine, client):
            declared = await client.post("/generate", json={"text": "a" * 3000})
            streamed = await client.post("/generate", content=chunked())
        assert declared.status_code == 413 and streamed.status_code == 413
        assert declared.json()["error"]["param"] == "body"
        assert engine.stats.submitted == 0

    @pytest.mark.asyncio
    async def test_prompt_over_the_bound(self):
        """max_prompt_tokens bounds prompts below max_context."""
        async with serving(ServerSettings(max_prompt_tokens=8)) as (engine, client):
            response = await client.post("/generate", json={"input_ids": list(range(1, 10))})
            fits = await client.post("/generate", json={"input_ids": list(range(1, 9)),
                                                        "sampling_params": {"max_new_tokens": 1}})
        assert response.status_code == 400 and "at most 8 tokens" in response.json()["error"]["limit"]
        assert fits.status_code == 200


class TestBackpressure:
    @pytest.mark.asyncio
    async def test_full_engine_queue_is_503(self):
        """While the engine's inbox is full, a new request is a 503 with Retry-After; the rest complete."""
        gate = StepGate()
        async with serving(faults=FaultInjector(fail_step=gate), max_queued=2) as (engine, client):
            statuses: list[int] = []

            async def request() -> None:
                response = await client.post("/generate", json={**OK, "sampling_params": {"max_new_tokens": 2}})
                statuses.append(response.status_code)

            async with anyio.create_task_group() as tg:
                tg.start_soon(request)
                await gate.wait_entered()  # the loop is inside a model step: the inbox fills
                tg.start_soon(request)
                tg.start_soon(request)
                with anyio.fail_after(5):
                    while engine.stats.submitted < 3:
                        await anyio.sleep(0.01)
                rejected = await client.post("/generate", json=OK)
                gate.open()
        assert rejected.status_code == 503 and rejected.headers["retry-after"] == "1"
        assert "queue is full" in rejected.json()["error"]["message"]
        assert sorted(statuses) == [200, 200, 200]

    @pytest.mark.asyncio
    async def test_n_over_max_queued_is_400_on_n(self):
        """n over max_queued can never be queued: a 400 naming n and the limit, even on an idle server (not a
        503 to retry); the engine refuses it the same way, before anything is queued."""
        async with serving(max_queued=4) as (engine, client):
            response = await client.post("/v1/completions", json={"prompt": "x", "n": 5, "max_tokens": 1})
            fits = await client.post("/v1/completions", json={"prompt": "x", "n": 4, "max_tokens": 1})
            with pytest.raises(InvalidRequest, match=r"SamplingParams.n must be <= max_queued = 4"):
                engine.generate("x", SamplingParams(n=5))
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "n" and "max_queued = 4" in error["limit"], error
        assert error["message"].startswith("n must be") and "retry-after" not in response.headers
        assert fits.status_code == 200 and engine.stats.submitted == 1

    @pytest.mark.asyncio
    async def test_inflight_bound_is_503(self):
        """More generation requests than max_inflight at once is a 503 with Retry-After."""
        gate = StepGate()
        settings = ServerSettings(max_inflight=1, retry_after_s=3)
        async with serving(settings, faults=FaultInjector(fail_step=gate)) as (engine, client):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json=OK))
                await gate.wait_entered()
                rejected = await client.post("/v1/completions", json={"prompt": "x"})
                gate.open()
        assert rejected.status_code == 503 and rejected.headers["retry-after"] == "3"
        assert engine.stats.submitted == 1

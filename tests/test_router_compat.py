"""What routers send: bodies as SGLang Model Gateway re-serializes them, unknown fields ignored with one
warning per name, vLLM's and SGLang's fields that would change the answer refused, SGLang's /generate
body, and request ids from headers."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from engine import InvalidRequest
from engine.serve.field_policy import unknown_field
from engine.serve.unsupported_fields import BODY, SAMPLING_PARAMS, Unsupported
from engine.testing import FaultInjector
from http_helpers import StepGate, serving, stream_events

PROMPT = [5, 17, 42, 99, 3, 8]
GREEDY = {"temperature": 0, "max_tokens": 6}
# the bodies SGLang Model Gateway 0.3.2 sent for a client's plain ones (captured on this machine)
GATEWAY_EXTRAS = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                  "return_hidden_states": False}
CHAT_EXTRAS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False}
GENERATE_EXTRAS = {"model": None, "return_text_in_logprobs": False, "log_metrics": True, "return_hidden_states": False,
                   "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False}


def _off_value(entry: Unsupported) -> Any:
    """A value that is not neutral for `entry` (what a client asking for the feature would send)."""
    neutral = entry.neutral
    if not neutral:
        return {"on": True}
    first = neutral[0]
    if isinstance(first, bool):
        return not first
    if isinstance(first, (int, float)):
        return first + 2
    if isinstance(first, list):
        return ["x"]
    if isinstance(first, dict):
        return {"x": 1}
    return first + "-x"


class TestGatewayBodies:
    @pytest.mark.asyncio
    async def test_gateway_bodies_answer_like_plain_ones(self):
        """Completions, chat and /generate with the gateway's extra fields give the plain bodies' answers."""
        async with serving() as (_, client):
            plain = await client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
            routed = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **GREEDY,
                                                                 "stream": False, **GATEWAY_EXTRAS})
            messages = [{"role": "user", "content": "hi there"}]
            chat_plain = await client.post("/v1/chat/completions", json={"messages": messages, **GREEDY})
            chat_routed = await client.post("/v1/chat/completions", json={
                "messages": messages, "model": "tiny", "temperature": 0, "max_completion_tokens": 6, "stream": False,
                **CHAT_EXTRAS})
            gen_plain = await client.post("/generate", json={"input_ids": PROMPT,
                                                             "sampling_params": {"max_new_tokens": 6}})
            gen_routed = await client.post("/generate", json={"input_ids": PROMPT, "stream": False, **GENERATE_EXTRAS,
                                                               "sampling_params": {"max_new_tokens": 6}})
        for answer in (plain, routed, chat_plain, chat_routed, gen_plain, gen_routed):
            assert answer.status_code == 200, answer.text
        assert routed.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert chat_routed.json()["choices"][0]["message"] == chat_plain.json()["choices"][0]["message"]
        assert gen_routed.json()["output_ids"] == gen_plain.json()["output_ids"]

    @pytest.mark.asyncio
    async def test_one_warning_per_ignored_field_name(self):
        """An unknown field is served without, and warned about once per name (nested ones too)."""
        body = {"prompt": PROMPT, **GREEDY, "frobnicate_compat_test": 1,
                "stream_options": {"include_usage": True, "frobnicate_option_test": 2}}
        async with serving() as (_, client):
            with capture_logs() as logs:
                for _ in range(3):
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
        warned = [e["field"] for e in logs if e["event"] == "http.ignored_field"]
        assert warned.count("frobnicate_compat_test") == 1
        assert warned.count("stream_options.frobnicate_option_test") == 1


class TestRefused:
    def test_every_unsupported_field_is_refused_unless_neutral(self):
        """Each listed field at a value that would change the answer is refused naming it; null and its
        neutral values are ignored."""
        for prefix, table in (("", BODY), ("sampling_params.", SAMPLING_PARAMS)):
            for name, entry in table.items():
                with pytest.raises(InvalidRequest, match="not supported by this server") as info:
                    unknown_field(prefix, name, _off_value(entry))
                assert info.value.field == f"{prefix}{name}"
                for value in (None, *entry.neutral):
                    unknown_field(prefix, name, value)

    @pytest.mark.asyncio
    async def test_refusals_and_neutral_values_over_http(self):
        """Over HTTP: a 400 naming the field before the engine sees anything; every field at its neutral
        value at once is served."""
        cases = [("/v1/completions", {"prompt": PROMPT, "min_tokens": 4}, "min_tokens"),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1.2},
                  "repetition_penalty"),
                 ("/generate", {"input_ids": PROMPT, "return_logprob": True}, "return_logprob"),
                 ("/generate", {"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 2}},
                  "sampling_params.min_new_tokens")]
        async with serving() as (engine, client):
            for path, body, field in cases:
                answer = await client.post(path, json=body)
                assert answer.status_code == 400 and answer.json()["error"]["param"] == field, (path, answer.text)
            assert engine.stats.submitted == 0
            neutral = {name: (entry.neutral or (None,))[0] for name, entry in BODY.items()}
            for path, body in (("/generate", {"input_ids": PROMPT}),
                               ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})):
                answer = await client.post(path, json={**neutral, **body})  # every field at once
                assert answer.status_code == 200, (path, answer.text)
            neutral_params = {name: (entry.neutral or (None,))[0] for name, entry in SAMPLING_PARAMS.items()}
            answer = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": neutral_params})
            assert answer.status_code == 200, answer.text

    @pytest.mark.asyncio
    async def test_add_special_tokens_is_taken(self):
        """vLLM's add_special_tokens is a field of completions and chat (not ignored, not refused)."""
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        async with serving() as (_, client):
            ok = [await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                             "add_special_tokens": False}),
                  await client.post("/v1/chat/completions", json={**chat, "add_special_tokens": True})]
            bad = [await client.post("/v1/completions", json={"prompt": "x", "add_special_tokens": "no"}),
                   await client.post("/v1/chat/completions", json={**chat, "add_special_tokens": 1})]
        assert [a.status_code for a in ok] == [200, 200]
        assert all(a.status_code == 400 and a.json()["error"]["param"] == "add_special_tokens" for a in bad)


class TestSGLangGenerate:
    @pytest.mark.asyncio
    async def test_model_seed_and_top_k_spellings(self):
        """/generate takes SGLang's model (null or the served one), sampling_seed and top_k -1."""
        sampled = {"max_new_tokens": 8, "temperature": 0.9, "ignore_eos": True}
        async with serving() as (_, client):
            seed = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {**sampled, "seed": 7}})
            sglang = await client.post("/generate", json={"input_ids": PROMPT, "model": "tiny", "sampling_params": {
                **sampled, "sampling_seed": 7, "top_k": -1, "top_p": None}})
            other = await client.post("/generate", json={"input_ids": PROMPT, "model": "gpt-9"})
        assert seed.status_code == sglang.status_code == 200
        assert sglang.json()["output_ids"] == seed.json()["output_ids"]
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"


class TestRequestIds:
    @pytest.mark.asyncio
    async def test_headers_and_body_fields_become_the_request_id(self):
        """X-Request-Id (else X-Correlation-Id) is the id; a /v1 request_id wins; the answer echoes it."""
        body = {"prompt": PROMPT, "max_tokens": 2}
        async with serving() as (_, client):
            header = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "gw-1"})
            corr = await client.post("/generate", json={"input_ids": PROMPT}, headers={"X-Correlation-Id": "corr-2"})
            field = await client.post("/v1/completions", json={**body, "request_id": "body-3"},
                                      headers={"X-Request-Id": "gw-3"})
            bad = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 200})
            events = await stream_events(client, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True})
        assert header.json()["id"] == header.headers["x-request-id"] == "gw-1"
        assert corr.json()["meta_info"]["id"] == corr.headers["x-request-id"] == "corr-2"
        assert field.json()["id"] == "body-3"
        assert bad.status_code == 200 and bad.json()["id"].startswith("cmpl-")
        assert events[0]["id"].startswith("chatcmpl-")

    @pytest.mark.asyncio
    async def test_a_header_id_already_in_flight_is_made_unique(self):
        """A router retrying on the same instance with the same id is served under a suffixed id."""
        gate = StepGate()
        async with serving(faults=FaultInjector(fail_step=gate)) as (_, client):
            results = {}

            async def first() -> None:
                results["first"] = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                                                     headers={"X-Request-Id": "retry-me"})

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await gate.wait_entered()
                async with anyio.create_task_group() as inner:
                    inner.start_soon(lambda: _second(client, results))
                    await anyio.sleep(0.2)
                    gate.open()
        assert results["first"].json()["id"] == "retry-me"
        second = results["second"].json()["id"]
        assert results["second"].status_code == 200 and second.startswith("retry-me-") and len(second) == 17


async def _second(client, results) -> None:
    results["second"] = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                                          headers={"X-Request-Id": "retry-me"})

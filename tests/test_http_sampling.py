"""n > 1, logprobs and stop strings through the real `openai` client: the engine's own features
(SamplingParams n / logprobs / stop, RequestOutput.index / logprobs / new_text) in OpenAI's shapes."""

from __future__ import annotations

import pytest

from engine import FinishReason, RequestOutput, SamplingParams
from engine.model.tokenizer import ByteTokenizer
from engine.outputs import TokenLogprob
from engine.serve.generation import Generation
from engine.serve.openai_format import chat_events, chat_json, completion_json
from engine.serve.schemas import GenerateBody
from http_helpers import parse_sse, serving, stream_events

import openai  # noqa: E402 - in the test extra: a missing one fails, never skips

PROMPT = "The quick brown fox"
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11}


def _client(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0,
                              timeout=10)


async def _expected(engine, prompt, i: int, max_tokens: int, **params):
    """What the engine gives sequence i of an n > 1 request alone (seed + i)."""
    seeded = dict(params, seed=params["seed"] + i) if "seed" in params else params
    return await engine.complete(prompt, SamplingParams(max_new_tokens=max_tokens, **seeded))


class TestN:
    @pytest.mark.asyncio
    async def test_completions_n3_whole_and_streamed(self):
        """n=3: three choices, each what the engine gives its sequence alone; the stream's deltas add up
        per index; usage counts all three."""
        async with serving() as (engine, client):
            expected = [(await _expected(engine, PROMPT, i, 8, **SEEDED)).text for i in range(3)]
            oa = _client(client)
            try:
                whole = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, **SEEDED)
                stream = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, stream=True,
                                                     stream_options={"include_usage": True}, **SEEDED)
                chunks = [chunk async for chunk in stream]
            finally:
                await oa.close()
        assert sorted(c.index for c in whole.choices) == [0, 1, 2]
        assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
        streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                    for i in range(3)]
        assert streamed == expected
        finals = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
        assert finals == {0, 1, 2}
        assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 3 * 8

    @pytest.mark.asyncio
    async def test_chat_n3_streamed(self):
        """Chat with n=3: a role chunk per choice, then deltas that add up to each whole answer."""
        messages = [{"role": "user", "content": "hi"}]
        async with serving() as (_, client):
            oa = _client(client)
            try:
                whole = await oa.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=3,
                                                         **SEEDED)
                stream = await oa.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=3,
                                                          stream=True, **SEEDED)
                chunks = [chunk async for chunk in stream]
            finally:
                await oa.close()
        roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
        assert roles == [0, 1, 2]
        streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                    for i in range(3)}
        assert streamed == {c.index: c.message.content for c in whole.choices}

    @pytest.mark.asyncio
    async def test_n3_client_leaving_finishes_every_sequence(self):
        """A client that leaves an n=3 stream aborts all three sequences; the pools end whole (conftest)."""
        async with serving() as (engine, client):
            body = {"prompt": PROMPT, "max_tokens": 200, "n": 3, "stream": True, "ignore_eos": True, **SEEDED}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break
            await engine.wait_idle(10)
        assert engine.stats.finishes[("normal", "ABORT")] == 3


class TestLogprobs:
    @pytest.mark.asyncio
    async def test_completion_logprobs_are_the_engines(self):
        """logprobs=2: per token the engine's logprob and its top 2, text offsets that add up."""
        # NOTE: no prefix cache: a cache hit prefills the prompt's tail alone, whose K/V then differ from the
        # first run's in the last float32 bits (GEMM results depend on the rows in a call)
        async with serving(prefix_cache=False) as (engine, client):
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=6, logprobs=2))
            entries = [e async for out in stream for e in (out.logprobs or ())]
            oa = _client(client)
            try:
                answer = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                                     logprobs=2)
            finally:
                await oa.close()
        logprobs = answer.choices[0].logprobs
        assert logprobs.token_logprobs == [e.logprob for e in entries]
        assert [len(top) for top in logprobs.top_logprobs] == [2] * 6
        assert [max(top.values()) for top in logprobs.top_logprobs] == [e.top[0][1] for e in entries]
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
        assert all(lp <= 0 for lp in logprobs.token_logprobs)

    @pytest.mark.asyncio
    async def test_chat_logprobs_whole_and_streamed(self):
        """Chat logprobs with top_logprobs=3: one content entry per token, whole or streamed, the same."""
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
                "logprobs": True, "top_logprobs": 3}
        async with serving() as (_, client):
            oa = _client(client)
            try:
                whole = await oa.chat.completions.create(model="tiny", **body)
            finally:
                await oa.close()
            events = await stream_events(client, "/v1/chat/completions", {**body, "stream": True})
        content = whole.choices[0].logprobs.content
        assert len(content) == whole.usage.completion_tokens == 5
        assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
        streamed = [entry for e in events[:-1] if e["choices"][0]["logprobs"]
                    for entry in e["choices"][0]["logprobs"]["content"]]
        assert [entry["logprob"] for entry in streamed] == [entry.logprob for entry in content]


class TestStopStrings:
    @pytest.mark.asyncio
    async def test_stop_string_across_token_boundaries(self):
        """A three-token stop string ends the request with STOP in the engine; whole and streamed text stop
        just before it, and no chunk ever shows part of it."""
        async with serving() as (engine, client):
            free = (await engine.complete(PROMPT, SamplingParams(max_new_tokens=24))).text
            stop = next(free[i:i + 3] for i in range(4, len(free) - 3)
                        if "\ufffd" not in free[i:i + 3] and free[i:i + 3] not in free[:i + 2])
            oa = _client(client)
            try:
                whole = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                                    stop=[stop])
            finally:
                await oa.close()
            events = await stream_events(client, "/v1/completions", {
                "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": stop, "stream": True})
            await engine.wait_idle(5)
        assert len(engine.tokenizer.encode(stop)) == 3
        expected = free[: free.index(stop)]
        assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
        deltas = [e["choices"][0]["text"] for e in events[:-1]]
        assert "".join(deltas) == expected and events[-2]["choices"][0]["finish_reason"] == "stop"
        assert engine.stats.finishes[("normal", "STOP")] == 2 and engine.stats.finishes[("normal", "ABORT")] == 0


class _Stream:
    """A RequestStream stand-in replaying given outputs."""

    def __init__(self, outputs):
        self.outputs = iter(outputs)

    async def __anext__(self):
        try:
            return next(self.outputs)
        except StopIteration:
            raise StopAsyncIteration from None

    def abandon(self):
        pass


class _Engine:
    tokenizer = ByteTokenizer()

    def __init__(self, outputs):
        self.outputs = outputs

    def generate(self, prompt, params, request_id):
        return _Stream(self.outputs)


def _outputs(logprobs: bool) -> list[RequestOutput]:
    """Two sequences of 'hi' and 'yo', interleaved, each token with its logprob and one alternative."""
    texts = {0: "hi", 1: "yo"}
    out = []
    for step in range(2):
        for index, text in texts.items():
            token = ord(text[step])
            entry = (TokenLogprob(token, -0.5 - step, ((token, -0.5 - step), (ord("z"), -2.0))),) if logprobs else None
            final = step == 1
            out.append(RequestOutput("r", [token], all_ids=[], num_ids=0, new_text=text[step], index=index,
                                     logprobs=entry, finished=final,
                                     finish_reason=FinishReason.LENGTH if final else None))
    return out


class TestFormats:
    """OpenAI's shapes for n > 1 and logprobs, from given engine outputs (parsed with openai's own types)."""

    @staticmethod
    async def _drain(generation):
        while await generation.next() is not None:
            pass

    @pytest.mark.asyncio
    async def test_completion_choices_and_legacy_logprobs(self):
        """Two choices; tokens, token_logprobs, top_logprobs as {token: logprob}, running text offsets."""
        body = GenerateBody("x", [1], SamplingParams(max_new_tokens=2, n=2, logprobs=1))
        generation = Generation(_Engine(_outputs(True)), body, route="/v1/completions")
        await self._drain(generation)
        answer = openai.types.Completion.model_validate(completion_json(generation, "tiny"))
        assert [c.text for c in answer.choices] == ["hi", "yo"] and answer.usage.completion_tokens == 4
        logprobs = answer.choices[1].logprobs
        assert logprobs.tokens == ["y", "o"] and logprobs.token_logprobs == [-0.5, -1.5]
        assert logprobs.top_logprobs == [{"y": -0.5, "z": -2.0}, {"o": -1.5, "z": -2.0}]
        assert logprobs.text_offset == [0, 1]

    @pytest.mark.asyncio
    async def test_chat_stream_choices_and_logprobs(self):
        """A role chunk per choice, deltas by index, content logprobs with bytes and top_logprobs."""
        body = GenerateBody("x", [1], SamplingParams(max_new_tokens=2, n=2, logprobs=1), stream=True)
        generation = Generation(_Engine(_outputs(True)), body, route="/v1/chat/completions")
        raw = b"".join([event async for event in chat_events(generation, "tiny")]).decode()
        events = parse_sse(raw.splitlines())
        chunks = [openai.types.chat.ChatCompletionChunk.model_validate(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and [c.choices[0].delta.role for c in chunks[:2]] == ["assistant"] * 2
        by_index = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                    for i in (0, 1)}
        assert by_index == {0: "hi", 1: "yo"}
        entry = chunks[2].choices[0].logprobs.content[0]
        assert (entry.token, entry.logprob, entry.bytes) == ("h", -0.5, [104])
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("h", -0.5), ("z", -2.0)]

    @pytest.mark.asyncio
    async def test_no_logprobs_unless_asked(self):
        """Without logprobs in the request every choice's logprobs is null."""
        body = GenerateBody("x", [1], SamplingParams(max_new_tokens=2, n=2))
        generation = Generation(_Engine(_outputs(False)), body, route="/v1/chat/completions")
        await self._drain(generation)
        answer = openai.types.chat.ChatCompletion.model_validate(chat_json(generation, "tiny"))
        assert [c.logprobs for c in answer.choices] == [None, None]
        assert [c.message.content for c in answer.choices] == ["hi", "yo"]

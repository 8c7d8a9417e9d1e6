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
from http_helpers import openai_client as _client, parse_sse, serving, stream_events

import openai  # noqa: E402 - in the test extra: a missing one fails, never skips

PROMPT = "The quick brown fox"
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11}



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


#: Logprobs of the same tokens computed along different paths (a prefix-cache hit computes the prompt's last
#: token alone, a miss in one batch with the rest) differ by float32 rounding (about 1e-6), not more.
LOGPROB_TOL = 1e-4


class TestLogprobs:
    @pytest.mark.asyncio
    async def test_completion_logprobs_are_the_engines(self):
        """logprobs=2: per token the engine's logprob and its top 2 (equal within float rounding: the server's
        request hits the prefix cache the engine's filled), top values consistent with token_logprobs, text
        offsets that never decrease and stay inside the text."""
        async with serving() as (engine, client):
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=6, logprobs=2))
            entries = [e async for out in stream for e in (out.logprobs or ())]
            oa = _client(client)
            try:
                answer = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                                     logprobs=2)
            finally:
                await oa.close()
        logprobs, text = answer.choices[0].logprobs, answer.choices[0].text
        assert logprobs.token_logprobs == pytest.approx([e.logprob for e in entries], abs=LOGPROB_TOL)
        assert [len(top) for top in logprobs.top_logprobs] == [2] * 6
        assert [max(top.values()) for top in logprobs.top_logprobs] == pytest.approx(
            [e.top[0][1] for e in entries], abs=LOGPROB_TOL)
        assert all(top[token] == lp for token, lp, top in
                   zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs) if token in top)
        offsets = logprobs.text_offset
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
        assert all(lp <= 0 for lp in logprobs.token_logprobs)

    @pytest.mark.asyncio
    async def test_colliding_top_texts_keep_token_logprobs(self):
        """Greedy with logprobs=20 on the byte model: many alternatives decode to the same U+FFFD; each
        text appears once, and the sampled token's text carries exactly its token_logprobs value."""
        async with serving() as (_, client):
            oa = _client(client)
            try:
                answer = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                     logprobs=20)
            finally:
                await oa.close()
        logprobs = answer.choices[0].logprobs
        shared = [i for i, (token, top) in enumerate(zip(logprobs.tokens, logprobs.top_logprobs))
                  if token in top and len(top) < 20]  # the sampled token's text is shared with another
        assert shared, "no colliding texts: the test would not test anything"
        for i in shared:
            assert logprobs.top_logprobs[i][logprobs.tokens[i]] == logprobs.token_logprobs[i]
        assert all(top[t] == lp for t, lp, top in
                   zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs) if t in top)

    @pytest.mark.asyncio
    async def test_text_offsets_stay_inside_the_text(self):
        """A character spread over two tokens (the byte model's greedy output holds one) moves the offset
        once: each whole token's text is found at its offset, offsets never decrease and never pass the end
        of the text, whole or streamed."""
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1}
        async with serving() as (_, client):
            oa = _client(client)
            try:
                answer = await oa.completions.create(model="tiny", **body)
            finally:
                await oa.close()
            events = await stream_events(client, "/v1/completions", {**body, "stream": True})
        text, logprobs = answer.choices[0].text, answer.choices[0].logprobs
        assert len(text) < sum(len(t) for t in logprobs.tokens)  # some character spans tokens
        streamed = [o for e in events[:-1] if e["choices"][0]["logprobs"]
                    for o in e["choices"][0]["logprobs"]["text_offset"]]
        for offsets in (logprobs.text_offset, streamed):
            assert len(offsets) == 16 and offsets == sorted(offsets) and 0 <= offsets[-1] <= len(text)
            whole = [(t, o) for t, o in zip(logprobs.tokens, offsets) if t and "\ufffd" not in t]
            assert whole and all(text[o:o + len(t)] == t for t, o in whole), (text, logprobs.tokens, offsets)

    @pytest.mark.asyncio
    async def test_chat_logprob_bytes_rebuild_the_message(self):
        """Chat logprobs' bytes are each token's own bytes (a lone byte of a multi-byte character is that
        byte, not U+FFFD's three), so joined they decode to the message."""
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 1.0, "seed": 0,
                "logprobs": True, "top_logprobs": 2}
        async with serving() as (engine, client):
            oa = _client(client)
            try:
                answer = await oa.chat.completions.create(model="tiny", **body)
            finally:
                await oa.close()
        content, message = answer.choices[0].logprobs.content, answer.choices[0].message.content
        assert any(entry.bytes == [b] and b >= 0x80 for entry in content for b in entry.bytes)
        assert bytes(b for entry in content for b in entry.bytes).decode("utf-8", errors="replace") == message
        assert all(list(engine.tokenizer.encode(entry.token)) == entry.bytes
                   for entry in content if entry.token != "\ufffd")

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


class TestLogprobDocs:
    def test_docs_describe_the_logprobs_the_server_computes(self):
        """docs/http.md describes logprobs as computed (the tests above check them end to end), with the
        bytes, colliding texts and offsets rules; it no longer says they are missing or expected to fail."""
        from pathlib import Path

        text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "http.md").read_text().split())
        section = text[text.index("- **Logprobs**"):text.index("### Failed requests")]
        assert "does not compute" not in section and "xfail" not in section and "empty entries" not in section
        for rule in ("the token's own bytes", "sampled token's own logprob", "never pass the end of the text",
                     "the model dtype's rounding"):
            assert rule in section, rule


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

    @pytest.mark.asyncio
    async def test_split_characters_and_colliding_texts(self):
        """'éé!' as five byte tokens: chat bytes are each token's own byte; completion offsets move once per
        character and end inside the text; alternatives that all show U+FFFD keep the sampled one's value."""
        ids = [0xC3, 0xA9, 0xC3, 0xA9, 0x21]
        top = {0xC3: ((0x80, -0.5), (0xC3, -2.0), (0x41, -3.0))}  # a better token shares the sampled one's text
        outputs = [RequestOutput("r", [t], all_ids=[], num_ids=0, new_text="é" if i % 2 else ("!" if i == 4 else ""),
                                 logprobs=(TokenLogprob(t, -2.0 if t == 0xC3 else -0.25,
                                                        top.get(t, ((t, -0.25), (0x80, -4.0)))),),
                                 finished=i == 4, finish_reason=FinishReason.LENGTH if i == 4 else None)
                   for i, t in enumerate(ids)]
        body = GenerateBody("x", [1], SamplingParams(max_new_tokens=5, logprobs=3))
        completion = Generation(_Engine(outputs), body, route="/v1/completions")
        await self._drain(completion)
        chat = Generation(_Engine(outputs), body, route="/v1/chat/completions")
        await self._drain(chat)
        legacy = openai.types.Completion.model_validate(completion_json(completion, "tiny")).choices[0]
        content = openai.types.chat.ChatCompletion.model_validate(chat_json(chat, "tiny")).choices[0].logprobs.content
        assert legacy.text == "éé!" and legacy.logprobs.text_offset == [0, 0, 1, 1, 2]
        assert [e.bytes for e in content] == [[t] for t in ids]
        assert bytes(b for e in content for b in e.bytes).decode() == "éé!"
        assert legacy.logprobs.top_logprobs[0] == {"\ufffd": -2.0, "A": -3.0}  # the sampled token's own value
        assert legacy.logprobs.top_logprobs[1] == {"\ufffd": -0.25}  # two U+FFFD alternatives: the best
        assert legacy.logprobs.token_logprobs[:2] == [-2.0, -0.25]

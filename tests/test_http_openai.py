"""The official `openai` client drives /v1/completions (skipped if the package is not installed)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from http_helpers import serving

openai = pytest.importorskip("openai")


class TestOpenAIClient:
    @pytest.mark.asyncio
    async def test_completions_plain_and_streamed(self):
        """A completion and a streamed completion through the openai client match the embedded API."""
        async with serving() as (engine, client):
            expected = await engine.complete("Hello", SamplingParams(max_new_tokens=6))
            text = engine.tokenizer.decode(expected.token_ids)
            oa = openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=10)
            try:
                models = await oa.models.list()
                completion = await oa.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
                stream = await oa.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
                chunks = [chunk async for chunk in stream]
            finally:
                await oa.close()
        assert [m.id for m in models.data] == ["tiny"]
        assert completion.choices[0].text == text and completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 6 and completion.usage.prompt_tokens == 5
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].usage.total_tokens == 11

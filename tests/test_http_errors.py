"""Every 4xx/5xx is JSON in OpenAI's shape (unknown routes and wrong methods included), and the API key
guards every route but /health, as vLLM's --api-key does."""

from __future__ import annotations

import anyio
import pytest
from structlog.testing import capture_logs

from engine.serve.settings import ServerSettings
from engine.testing import FaultInjector
from http_helpers import StepGate, serving

openai = pytest.importorskip("openai")

KEY = "sk-test-3141"
ROUTES = [("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/v1/models"), ("POST", "/abort"), ("GET", "/health_generate"), ("GET", "/metrics"),
          ("GET", "/debug/memory"), ("GET", "/no/such/route")]


def _assert_openai_error(response, status: int) -> dict:
    assert response.status_code == status and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    return error


class TestErrorShape:
    @pytest.mark.asyncio
    async def test_unknown_route_and_wrong_method(self):
        """An unknown route is a JSON 404; a wrong method a JSON 405 with Allow."""
        async with serving() as (_, client):
            unknown = await client.get("/v2/everything")
            wrong = await client.get("/v1/completions")
            delete = await client.delete("/health")
        assert _assert_openai_error(unknown, 404)["type"] == "not_found_error"
        assert "/v2/everything" in unknown.json()["error"]["message"]
        assert _assert_openai_error(wrong, 405)["type"] == "invalid_request_error"
        assert wrong.headers["allow"] == "POST" and "GET" in wrong.json()["error"]["message"]
        _assert_openai_error(delete, 405)

    @pytest.mark.asyncio
    async def test_openai_client_sees_typed_errors(self):
        """The openai client raises its typed errors from these bodies, with the message and param."""
        async with serving() as (_, client):
            oa = openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="x", max_retries=0)
            try:
                with pytest.raises(openai.BadRequestError) as bad:
                    await oa.completions.create(model="tiny", prompt="x", max_tokens=0)
                with pytest.raises(openai.NotFoundError):
                    await oa.completions.create(model="other", prompt="x")
            finally:
                await oa.close()
        assert bad.value.body["param"] == "max_tokens" and "max_tokens" in bad.value.message

    @pytest.mark.asyncio
    async def test_overloaded_is_503_json(self):
        """A 503 from the in-flight bound is JSON too, with Retry-After."""
        gate = StepGate()
        async with serving(ServerSettings(max_inflight=1), faults=FaultInjector(fail_step=gate)) as (_, client):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.post("/generate", json={"input_ids": [1, 2]}))
                await gate.wait_entered()
                rejected = await client.post("/generate", json={"input_ids": [1, 2]})
                gate.open()
        assert _assert_openai_error(rejected, 503)["type"] == "service_unavailable"
        assert rejected.headers["retry-after"] == "1"


class TestAPIKey:
    @pytest.mark.asyncio
    async def test_every_route_but_health_needs_the_key(self):
        """Without the key (or with another) every route but /health answers 401 in OpenAI's shape."""
        with capture_logs() as logs:
            async with serving(ServerSettings(api_key=KEY)) as (engine, client):
                health = await client.get("/health")
                missing = [await client.request(m, p, json={}) for m, p in ROUTES]
                wrong = [await client.request(m, p, json={}, headers={"Authorization": "Bearer nope"})
                         for m, p in ROUTES]
                basic = await client.get("/v1/models", headers={"Authorization": KEY})
                ok = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert health.status_code == 200 and ok.status_code == 200
        for response in [*missing, *wrong, basic]:
            assert _assert_openai_error(response, 401)["type"] == "authentication_error"
            assert response.headers["www-authenticate"] == "Bearer"
        assert engine.stats.submitted == 0
        assert KEY not in repr(logs) and all(KEY not in r.text for r in [*missing, *wrong, basic])

    @pytest.mark.asyncio
    async def test_openai_client_with_and_without_the_key(self):
        """The openai client works with the key and raises AuthenticationError without it."""
        async with serving(ServerSettings(api_key=KEY)) as (_, client):
            base = str(client.base_url).rstrip("/") + "/v1"
            good = openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=10)
            bad = openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=10)
            try:
                answer = await good.chat.completions.create(model="tiny", max_tokens=2,
                                                            messages=[{"role": "user", "content": "hi"}])
                with pytest.raises(openai.AuthenticationError):
                    await bad.models.list()
            finally:
                await good.close()
                await bad.close()
        assert answer.usage.completion_tokens == 2

"""Shared builders for the HTTP server tests: a served engine, SSE parsing, a step gate."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx

from engine import Engine
from engine.serve.server import ServerSettings, running_server
from helpers import small_config

DEADLINE_S = 30


@asynccontextmanager
async def serving(settings: ServerSettings | None = None, *, deadline: float = DEADLINE_S, faults: Any = None,
                  **overrides: Any) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    """A small engine behind a real uvicorn server on 127.0.0.1 (ephemeral port), and a client."""
    with anyio.fail_after(deadline):
        async with Engine(small_config(**overrides), faults=faults) as engine:
            async with running_server(engine, settings=settings) as url:
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    yield engine, client
            await engine.wait_idle(5)


def parse_sse(lines: list[str]) -> list[Any]:
    """The payloads of `data:` lines: JSON objects, and the string "[DONE]"."""
    payloads = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


async def stream_events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming request and return every SSE payload."""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse([line async for line in response.aiter_lines()])


class StepGate:
    """A FaultInjector `fail_step` that holds every model step until opened (never fails one)."""

    def __init__(self) -> None:
        self.open_event = threading.Event()
        self.entered = threading.Event()

    def __call__(self, request_ids) -> bool:
        self.entered.set()
        self.open_event.wait(10)
        return False

    def open(self) -> None:
        self.open_event.set()

    async def wait_entered(self) -> None:
        await anyio.to_thread.run_sync(self.entered.wait, 10)

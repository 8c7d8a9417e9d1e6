"""`kvlife serve --api-process` as a user runs it: two processes. SIGTERM drains both (streams in flight
get their final event, exit 0, leak check clean); the API process dying stops the server (exit 1, for a
supervisor), and the engine's process dying takes the API process with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from http_helpers import ServeProcess, parse_sse

SERVE = [sys.executable, "-m", "engine.cli.main", "serve", "--host", "127.0.0.1", "--port", "0", "--api-process",
         "--max-running", "8", "--page-size", "16", "--num-kv-pages", "160", "--max-context", "2048"]


def _alive(pid: int | None) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _kill(pid: int | None) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


async def _first_event_then_rest(client: httpx.AsyncClient, first: anyio.Event, results: list) -> None:
    body = {"input_ids": [1, 2, 3, 4], "stream": True, "sampling_params": {"max_new_tokens": 2000}}
    lines = []
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if line.startswith("data: "):
                first.set()
    results.append(parse_sse(lines))


async def _serving(then) -> tuple[ServeProcess, int | None, object]:
    """Start the server, run `then(server, client)` once it serves; kill both processes by pid at the end."""
    process = await anyio.open_process(SERVE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = ServeProcess(process)
    result = None
    try:
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.read_logs)
                await server.started.wait()
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
                    result = await then(server, client)
                await process.wait()
    finally:
        _kill(server.api_pid)
        if process.returncode is None:
            process.kill()
            await process.wait()
        await process.aclose()
    return server, process.returncode, result


class TestTwoProcesses:
    @pytest.mark.asyncio
    async def test_sigterm_drains_streams_through_both_processes(self):
        async def then(server, client):
            assert server.api_pid is not None and server.api_pid != server.process.pid
            assert (await client.get("/health")).status_code == 200
            results: list = []
            async with anyio.create_task_group() as streams:
                firsts = [anyio.Event() for _ in range(3)]
                for first in firsts:
                    streams.start_soon(_first_event_then_rest, client, first, results)
                for first in firsts:
                    await first.wait()
                server.process.send_signal(signal.SIGTERM)
            return results

        server, code, results = await _serving(then)
        assert code == 0, server.logs[-5:]
        assert len(results) == 3
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["finished"] and events[-2]["meta_info"]["finish_reason"] == "shutdown"
        verdict = server.events("server.leak_check")
        assert len(verdict) == 1 and verdict[0]["verdict"] == "clean"
        assert {s["finish_reason"] for s in server.events("request.summary")} == {"shutdown"}
        with anyio.fail_after(10):
            while _alive(server.api_pid):
                await anyio.sleep(0.05)

    @pytest.mark.asyncio
    async def test_the_api_process_dying_stops_the_server_with_exit_1(self):
        async def then(server, client):
            answer = await client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params":
                                                          {"max_new_tokens": 4}})
            assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 4
            os.kill(server.api_pid, signal.SIGKILL)

        server, code, _ = await _serving(then)
        assert code == 1
        assert server.events("server.api_process_exited")[0]["exit_code"] == -signal.SIGKILL
        verdict = server.events("server.leak_check")
        assert len(verdict) == 1 and verdict[0]["verdict"] == "clean"

    @pytest.mark.asyncio
    async def test_the_engines_process_dying_takes_the_api_process_with_it(self):
        async def then(server, client):
            assert (await client.get("/health")).status_code == 200
            server.process.kill()
            with anyio.fail_after(20):
                while _alive(server.api_pid):
                    await anyio.sleep(0.05)
            return server.api_pid

        server, code, api_pid = await _serving(then)
        assert code == -signal.SIGKILL and not _alive(api_pid)

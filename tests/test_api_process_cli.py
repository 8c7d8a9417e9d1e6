"""`kvlife serve --api-process` as a user runs it: two processes. The API process dying stops the server
(exit 1, for a supervisor), and the engine's process dying takes the API process with it. (SIGTERM with
streams in flight, through both processes: tests/test_http_sigterm.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import httpx
import pytest

from http_helpers import ServeProcess, process_alive

SERVE = [sys.executable, "-m", "engine.cli.main", "serve", "--host", "127.0.0.1", "--port", "0", "--api-process",
         "--max-running", "8", "--page-size", "16", "--num-kv-pages", "160", "--max-context", "2048"]


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
        await server.kill()
    return server, process.returncode, result


class TestTwoProcesses:
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
                while process_alive(server.api_pid):
                    await anyio.sleep(0.05)
            return server.api_pid

        server, code, api_pid = await _serving(then)
        assert code == -signal.SIGKILL and not process_alive(api_pid)

"""`kvlife serve` in its own process: SIGTERM with streams in flight ends them with SHUTDOWN, exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys

import anyio
import httpx
import pytest

from http_helpers import ServeProcess, parse_sse

SERVE = [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--max-running", "8", "--page-size", "16",
         "--num-kv-pages", "160", "--max-context", "2048"]


async def _stream_until_end(client: httpx.AsyncClient, first_event: anyio.Event, results: list) -> None:
    body = {"input_ids": [1, 2, 3, 4], "stream": True, "sampling_params": {"max_new_tokens": 2000}}
    lines = []
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if line.startswith("data: "):
                first_event.set()
    results.append(parse_sse(lines))


class TestSigterm:
    @pytest.mark.asyncio
    async def test_sigterm_with_streams_in_flight(self):
        """Streams in flight get a final 'shutdown' event, the leak check is logged clean, exit code 0."""
        process = await anyio.open_process(SERVE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        server = ServeProcess(process)
        try:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(server.read_logs)
                    await server.started.wait()
                    url = f"http://127.0.0.1:{server.port}"
                    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                        assert (await client.get("/health")).status_code == 200
                        results: list = []
                        async with anyio.create_task_group() as streams:
                            firsts = [anyio.Event() for _ in range(3)]
                            for first in firsts:
                                streams.start_soon(_stream_until_end, client, first, results)
                            for first in firsts:
                                await first.wait()
                            process.send_signal(signal.SIGTERM)
                    returncode = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()
        assert returncode == 0, server.logs[-5:]
        assert len(results) == 3
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["finished"] and events[-2]["meta_info"]["finish_reason"] == "shutdown"
        verdict = server.events("server.leak_check")
        assert len(verdict) == 1 and verdict[0]["verdict"] == "clean"
        assert all(pool["held"] == 0 for pool in verdict[0]["pools"].values())
        assert server.events("server.stopping")[0]["signal"] == "SIGTERM"
        summaries = server.events("request.summary")
        assert len(summaries) == 3 and {s["finish_reason"] for s in summaries} == {"shutdown"}
        assert not server.events("unparsed"), server.events("unparsed")  # every line is JSON
        assert all(e["level"] in ("info", "warning", "error") for e in server.logs)

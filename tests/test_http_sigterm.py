"""`kvlife serve` in its own process: SIGTERM with streams in flight ends them with SHUTDOWN, exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys

import anyio
import httpx
import pytest

from http_helpers import ServeProcess, process_alive, stream_until_end

SERVE = [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--max-running", "8", "--page-size", "16",
         "--num-kv-pages", "160", "--max-context", "2048"]


class TestSigterm:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("options", [[], ["--api-process"]], ids=["one-process", "api-process"])
    async def test_sigterm_with_streams_in_flight(self, options):
        """Streams in flight get a final 'shutdown' event, the leak check is logged clean, exit code 0; with
        --api-process through both processes, and the API process is gone too."""
        process = await anyio.open_process(SERVE + options, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
                                streams.start_soon(stream_until_end, client, first, results)
                            for first in firsts:
                                await first.wait()
                            process.send_signal(signal.SIGTERM)
                    returncode = await process.wait()
        finally:
            await server.kill()
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
        assert (server.api_pid is not None) == bool(options)
        with anyio.fail_after(10):
            while process_alive(server.api_pid):
                await anyio.sleep(0.05)

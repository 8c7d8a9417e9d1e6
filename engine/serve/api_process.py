"""The engine's process's side of the API process (`ServerSettings.api_process`, `kvlife serve
--api-process`): start it with the public socket, watch it, stop it, and wait for it.

    front = FrontProcess(described, settings, public_sock, bridge)   # bridge: engine.serve.api_bridge
    await front.start(engine_url, tg)   # once the engine and its loopback server run; returns once it serves
    front.stop()                        # SIGTERM: it stops accepting, its streams end as the engine's do
    await front.close(timeout)          # after the engine left: wait for it (killed past `timeout`)

`exited` is set when the process ends, whoever ended it; `serve` stops the engine when it ends on
its own, as it does when its own HTTP server stops.
"""

from __future__ import annotations

import pickle
import signal
import socket
import subprocess
import sys
import anyio
import structlog
from anyio.abc import Process, TaskGroup

from engine import logging_configuration
from engine.serve.api_bridge import Bridge
from engine.serve.api_front import FrontHandoff
from engine.serve.remote_engine import EngineDescription
from engine.serve.settings import ServerSettings

__all__ = ["FrontProcess"]

log = structlog.get_logger("kvlife.http")

STARTUP_TIMEOUT = 120.0  # seconds for the API process to import, connect and listen

#: not `-m engine.serve.api_front`: the handoff's classes then unpickle from the module itself
_COMMAND = [sys.executable, "-c", "import sys; from engine.serve.api_front import main; sys.exit(main())"]


class FrontProcess:
    def __init__(self, described: EngineDescription, settings: ServerSettings, public_sock: socket.socket,
                 bridge: Bridge) -> None:
        self._described = described
        self._settings = settings
        self._sock = public_sock
        self._bridge = bridge
        self.process: Process | None = None
        self.exited = anyio.Event()
        self.stopping = False

    async def start(self, engine_url: str, tg: TaskGroup) -> None:
        """Spawn the API process on the public socket (listening from now: connections wait in its
        backlog until the process accepts them)."""
        self._sock.listen(2048)
        level, json_logs = logging_configuration()
        handoff = FrontHandoff(self._described, self._settings, self._sock.fileno(), self._bridge.path,
                               engine_url, level, json_logs)
        self.process = await anyio.open_process(_COMMAND,
                                                stdin=subprocess.PIPE, stdout=None, stderr=None,
                                                pass_fds=[self._sock.fileno()])
        assert self.process.stdin is not None
        await self.process.stdin.send(pickle.dumps(handoff))
        await self.process.stdin.aclose()
        tg.start_soon(self._watch)
        with anyio.fail_after(STARTUP_TIMEOUT):
            async with anyio.create_task_group() as first:
                async def until(event: anyio.Event) -> None:
                    await event.wait()
                    first.cancel_scope.cancel()

                first.start_soon(until, self._bridge.serving)
                first.start_soon(until, self.exited)
        if not self._bridge.serving.is_set():
            raise RuntimeError(f"the API process exited with {self.process.returncode} before serving")
        log.info("server.api_process", pid=self.process.pid)

    async def _watch(self) -> None:
        assert self.process is not None
        code = await self.process.wait()
        if not self.stopping:
            log.error("server.api_process_exited", pid=self.process.pid, exit_code=code)
        self.exited.set()

    def stop(self) -> None:
        """Ask it to stop accepting and finish its streams (SIGTERM)."""
        self.stopping = True
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)

    async def close(self, timeout: float) -> int | None:
        """Wait for it to exit, at most `timeout` seconds; then kill it. Its exit code (None if it never ran)."""
        self.stop()
        if self.process is None:
            return None
        with anyio.move_on_after(timeout):
            return await self.process.wait()
        log.warning("server.api_process_killed", pid=self.process.pid, after_s=timeout)
        self.process.kill()
        return await self.process.wait()

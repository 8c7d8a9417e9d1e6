"""Shared builders for the HTTP server tests: a served engine, SSE parsing, a step gate."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
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


@asynccontextmanager
async def api_serving(settings: ServerSettings | None = None, *, deadline: float = DEADLINE_S, faults: Any = None,
                      **overrides: Any) -> AsyncIterator[tuple[Engine, httpx.AsyncClient, Any, httpx.AsyncClient]]:
    """`serving()` as `kvlife serve --api-process` splits it, with both sides in this process: the engine's
    server and bridge, a RemoteEngine over the bridge's Unix socket, and the API process's app on its own
    uvicorn server. Yields (engine, a client of the front, the RemoteEngine, a client of the engine's server)."""
    from engine.serve.api_bridge import api_bridge
    from engine.serve.api_front import front_app
    from engine.serve.remote_engine import EngineDescription, RemoteEngine
    from engine.serve.server import running_app

    settings = settings or ServerSettings()
    with anyio.fail_after(deadline):
        async with Engine(small_config(**overrides), faults=faults) as engine:
            async with running_server(engine, settings=settings) as engine_url, api_bridge(engine) as bridge:
                remote = RemoteEngine(EngineDescription.of(engine), await anyio.connect_unix(bridge.path))
                async with anyio.create_task_group() as tg, \
                        httpx.AsyncClient(base_url=engine_url, timeout=None) as passer:
                    tg.start_soon(remote.run)
                    async with running_app(front_app(remote, settings, passer), settings=settings) as front_url, \
                            httpx.AsyncClient(base_url=front_url, timeout=10) as client, \
                            httpx.AsyncClient(base_url=engine_url, timeout=10) as direct:
                        yield engine, client, remote, direct
                    tg.cancel_scope.cancel()
            await engine.wait_idle(5)


async def leak_once(engine: Engine, client: httpx.AsyncClient) -> None:
    """Run one request through an engine whose kv release leaks (FaultInjector(fail_release={"kv"},
    release_leaks=True), leak_check="log") and wait for the idle leak check to find it."""
    engine._expect_leak = True  # NOTE: the conftest check then skips this engine's pools
    await client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    with anyio.fail_after(5):
        while engine.stats.leak_check_failures == 0:
            await anyio.sleep(0.01)


def openai_client(client: httpx.AsyncClient) -> Any:
    """The real `openai` SDK's async client for a `serving()` server (no retries: every failure shows)."""
    import openai

    return openai.AsyncOpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0,
                              timeout=10)


def transformers_chat_ids(directory, messages, **kwargs) -> list[int]:
    """transformers' own `apply_chat_template(..., add_generation_prompt=True, tokenize=True)` ids for the
    checkpoint in `directory`: what the server's chat prompt ids must equal."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


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


def write_chat_checkpoint(directory, chat_template: str, *, adds_bos: bool = False):
    """A tiny-model checkpoint with a byte-level `tokenizer.json` and `chat_template`, written by
    transformers' own `save_pretrained` (tokenizer_config.json, chat_template.jinja as it lays them out).
    `adds_bos`: the tokenizer's post-processor puts BOS before every encoded text (as Llama's,
    Mistral's and Gemma's do), while templates of those families also write ``{{ bos_token }}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from engine.model.checkpoint import save_checkpoint
    from engine.model.llama import LlamaModel
    from engine.model.model_config import ModelConfig

    config = ModelConfig.tiny()
    save_checkpoint(LlamaModel.from_seed(config, seed=0), config, directory)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", chat_template=chat_template)
    assert tokenizer.convert_tokens_to_ids(["<s>", "</s>", "<pad>"]) == [config.bos_token_id, config.eos_token_id,
                                                                         config.pad_token_id]
    if adds_bos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", config.bos_token_id)])
        assert tokenizer("a").input_ids[0] == config.bos_token_id
    tokenizer.save_pretrained(directory)
    return directory


class ServeProcess:
    """A `kvlife serve` subprocess whose JSON-lines stderr is collected as it arrives."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.logs: list[dict] = []
        self.started = anyio.Event()
        self.port = 0
        self.api_pid: int | None = None  # --api-process: the HTTP layer's process

    async def read_logs(self) -> None:
        buffer = b""
        async for data in self.process.stderr:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                try:
                    event = json.loads(line)
                except ValueError:
                    event = {"event": "unparsed", "line": line.decode(errors="replace")}
                self.logs.append(event)
                if event.get("event") == "server.api_process":
                    self.api_pid = event["pid"]
                if event.get("event") == "server.started":
                    self.port = event["port"]
                    self.started.set()

    def events(self, name: str) -> list[dict]:
        return [e for e in self.logs if e.get("event") == name]

    async def kill(self) -> None:
        """Cleanup, whatever happened: kill the server and its API process (if any) by pid."""
        kill_if_alive(self.api_pid)
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        await self.process.aclose()


async def stream_until_end(client: httpx.AsyncClient, first_event: anyio.Event, results: list) -> None:
    """Stream one long /generate to its end, setting `first_event` at its first event; its SSE into `results`."""
    body = {"input_ids": [1, 2, 3, 4], "stream": True, "sampling_params": {"max_new_tokens": 2000}}
    lines = []
    async with client.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if line.startswith("data: "):
                first_event.set()
    results.append(parse_sse(lines))


def process_alive(pid: int | None) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def kill_if_alive(pid: int | None) -> None:
    if process_alive(pid):
        os.kill(pid, signal.SIGKILL)

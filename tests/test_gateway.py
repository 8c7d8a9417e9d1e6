"""kvlife behind SGLang Model Gateway (`sglang-router==0.3.2`, policy cache_aware), real processes on
127.0.0.1: the openai client through the gateway gets what one instance gives directly; requests sharing
long prefixes keep landing where their pages are; an instance SIGKILLed under load is routed around
(no request hangs, the gateway retries what it can, the survivor is whole and exits clean).

The fleet (two `kvlife serve`, one gateway) is shared by the module; the kill test ends it and runs last.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from router_fleet import Gateway, KvlifeServer

BOUND_S = 60.0  # no request through the gateway may take longer, the kill included
MIGRATED = list(range(5, 45))  # the prompt of the streams a migrating router continues elsewhere
MIGRATED_TOKENS = 160


class Fleet:
    def __init__(self, root: Path) -> None:
        self.servers = [KvlifeServer(root / f"kvlife-{i}.log") for i in range(2)]
        self.gateway: Gateway | None = None

    def start(self) -> Fleet:
        for server in self.servers:
            server.ready()
        self.gateway = Gateway(self.servers[0].log.parent / "gateway.log", [s.url for s in self.servers]).ready()
        return self

    def close(self) -> None:
        for child in (self.gateway, *self.servers):
            if child is not None:
                child.kill()

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=BOUND_S)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("gateway"))
    try:
        yield fleet.start()
    finally:
        fleet.close()


def _served_by(fleet: Fleet, request_id: str) -> list[int]:
    return [i for i, server in enumerate(fleet.servers) if request_id in server.summaries()]


class TestThroughTheGateway:
    @pytest.mark.anyio
    async def test_openai_client_gets_what_one_instance_gives(self, fleet):
        """Completions, chat, streaming and n > 1 through the gateway equal the same requests to one
        instance directly (greedy, and seeded for n > 1); SGLang's /generate too."""
        prompt = "The gateway forwards this prompt"
        messages = [{"role": "user", "content": "Say something"}]
        async with openai.AsyncOpenAI(base_url=f"{fleet.servers[0].url}/v1", api_key="none",
                                      max_retries=0) as direct, fleet.client() as routed:
            with anyio.fail_after(BOUND_S):
                want = await direct.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
                got = await routed.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
                want_chat = await direct.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                                 temperature=0)
                got_chat = await routed.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                                temperature=0)
                stream = await routed.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                         stream=True)
                streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
                chat_stream = await routed.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                                   temperature=0, stream=True)
                chat_streamed = "".join([c.choices[0].delta.content or "" async for c in chat_stream if c.choices])
                want_n = await direct.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=3, seed=5,
                                                         temperature=0.9)
                got_n = await routed.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=3, seed=5,
                                                        temperature=0.9)
                async with httpx.AsyncClient(timeout=BOUND_S) as http:
                    body = {"text": prompt, "sampling_params": {"max_new_tokens": 12}}
                    want_gen = (await http.post(f"{fleet.servers[0].url}/generate", json=body)).json()
                    got_gen = (await http.post(f"{fleet.url}/generate", json=body)).json()
        assert got.choices[0].text == want.choices[0].text == streamed and got.usage.completion_tokens == 12
        assert got_chat.choices[0].message.content == want_chat.choices[0].message.content == chat_streamed
        assert [c.text for c in got_n.choices] == [c.text for c in want_n.choices] and len(got_n.choices) == 3
        assert got_gen["output_ids"] == want_gen["output_ids"] and got_gen["text"] == want.choices[0].text

    @pytest.mark.anyio
    async def test_shared_prefixes_keep_landing_where_their_pages_are(self, fleet):
        """Four families of prompts sharing 512-character prefixes: each family is served by one instance,
        and the prefix-cache hit ratio over both instances is what that affinity gives."""
        async with httpx.AsyncClient(timeout=BOUND_S) as http:
            assert (await http.post(f"{fleet.url}/flush_cache")).json()["workers_flushed"] == 2
        before = [server.metrics() for server in fleet.servers]
        families, per_family, prefix_chars = 4, 4, 512
        async with fleet.client() as routed:
            with anyio.fail_after(BOUND_S):
                for i in range(per_family):
                    for f in range(families):
                        prefix = "".join(chr(97 + (f * 7 + j * 3) % 26) for j in range(prefix_chars))
                        await routed.completions.create(model="tiny", prompt=f"{prefix} question {i}", max_tokens=2,
                                                        extra_headers={"X-Request-Id": f"family-{f}-{i}"})
        for f in range(families):
            homes = {tuple(_served_by(fleet, f"family-{f}-{i}")) for i in range(per_family)}
            assert len(homes) == 1 and len(next(iter(homes))) == 1, (f, homes)  # every request of a family: one home
        after = [server.metrics() for server in fleet.servers]
        hits = sum(a["kvlife:prefix_cache_hits_total"] - b["kvlife:prefix_cache_hits_total"]
                   for a, b in zip(after, before))
        queries = sum(a["kvlife:prefix_cache_queries_total"] - b["kvlife:prefix_cache_queries_total"]
                      for a, b in zip(after, before))
        ideal = families * (per_family - 1) * (prefix_chars // 16 * 16) / queries  # each family misses once
        assert hits / queries >= 0.95 * ideal and ideal > 0.6


class TestKilledInstance:
    @pytest.mark.anyio
    async def test_an_instance_killed_under_load(self, fleet):
        """SIGKILL an instance while requests run on it: every request ends within the bound, non-streaming
        ones in flight there are retried by the gateway and succeed on the survivor, the gateway stops
        sending to the dead one, later requests succeed, a stream cut by the kill is continued on the
        survivor with token-level continuation, the survivor is whole and exits clean."""
        outcomes: dict[str, str] = {}
        family = "a family of prompts " + "z" * 400  # most of the load shares it: cache_aware keeps it together
        requests = [(f"load-{i}", family + f" {i}" if i % 4 else f"another prompt {i} " * 4, i % 4 == 1)
                    for i in range(16)]
        ids, streams = {r for r, _, _ in requests}, {r for r, _, s in requests if s}

        async def one(client: openai.AsyncOpenAI, request_id: str, prompt: str, stream: bool) -> None:
            start = time.monotonic()
            headers = {"X-Request-Id": request_id}
            try:
                with anyio.fail_after(BOUND_S):
                    if stream:
                        chunks = await client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                                                 temperature=0, stream=True, extra_headers=headers)
                        text = "".join([c.choices[0].text async for c in chunks if c.choices])
                    else:
                        text = (await client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                                                temperature=0, extra_headers=headers)).choices[0].text
                outcomes[request_id] = "ok" if text else "empty"
            except openai.APIError as exc:
                outcomes[request_id] = f"error {type(exc).__name__}"
            assert time.monotonic() - start < BOUND_S

        def in_flight(server: KvlifeServer) -> set[str]:
            return ids & (server.submitted() - set(server.summaries()))

        streamed: dict[int, list[int]] = {}  # a migrating router's view: each instance's direct stream

        async def follow(index: int) -> None:
            body = {"input_ids": MIGRATED, "stream": True,
                    "sampling_params": {"max_new_tokens": MIGRATED_TOKENS, "ignore_eos": True}}
            streamed[index] = []
            with contextlib.suppress(httpx.HTTPError), anyio.fail_after(BOUND_S):
                async with httpx.AsyncClient(timeout=BOUND_S) as http:
                    async with http.stream("POST", f"{fleet.servers[index].url}/generate", json=body) as answer:
                        async for line in answer.aiter_lines():
                            if line.startswith("data: {"):
                                streamed[index] += json.loads(line[6:])["token_ids"]

        async with fleet.client() as client, anyio.create_task_group() as tg:
            for index in range(2):
                tg.start_soon(follow, index)
            for request_id, prompt, stream in requests:
                tg.start_soon(one, client, request_id, prompt, stream)
            with anyio.fail_after(BOUND_S):  # kill whichever instance has non-streaming requests running
                while not (victims := [s for s in fleet.servers if len(in_flight(s) - streams) >= 2]):
                    await anyio.sleep(0.02)
            victim = victims[0]
            victim.kill()  # SIGKILL by pid, mid-load
        survivor = next(s for s in fleet.servers if s is not victim)
        cut = in_flight(victim)
        assert len(outcomes) == len(requests)  # every request ended (each within the bound)
        assert len(cut - streams) >= 2
        for request_id in cut - streams:  # the gateway's retry ran them again on the survivor
            assert outcomes[request_id] == "ok" and request_id in survivor.summaries(), (
                f"{request_id}: {outcomes[request_id]}; survivor saw it: {request_id in survivor.submitted()}; "
                f"gateway log: {fleet.gateway.lines()[-12:]}")
        for request_id in cut & streams:  # a stream cut mid-way ends, as a result or an error, never empty
            assert outcomes[request_id] != "empty", request_id
        async with fleet.client() as client:
            with anyio.fail_after(BOUND_S):
                while victim.url in fleet.gateway.healthy_workers():
                    await anyio.sleep(0.2)
                later = [await client.completions.create(model="tiny", prompt=f"later {i}", max_tokens=4,
                                                         extra_body={"ignore_eos": True},  # never an empty text
                                                         extra_headers={"X-Request-Id": f"later-{i}"})
                         for i in range(6)]
        assert all(answer.choices[0].text for answer in later)
        assert all(f"later-{i}" in survivor.summaries() for i in range(6))
        await _continue_elsewhere(fleet, victim, survivor, streamed)
        await _assert_whole_and_exits_clean(survivor)


async def _continue_elsewhere(fleet: Fleet, victim: KvlifeServer, survivor: KvlifeServer,
                              streamed: dict[int, list[int]]) -> None:
    """What a migrating router does with the stream the kill cut: the prompt, the ids so far and the
    remaining budget to the survivor (token-level continuation); the ids then equal the uninterrupted
    stream's (greedy)."""
    cut, whole = streamed[fleet.servers.index(victim)], streamed[fleet.servers.index(survivor)]
    assert len(whole) == MIGRATED_TOKENS and 0 < len(cut) < MIGRATED_TOKENS
    async with httpx.AsyncClient(timeout=BOUND_S) as http:
        rest = (await http.post(f"{survivor.url}/generate", json={
            "input_ids": MIGRATED, "resume_output_ids": cut,
            "sampling_params": {"max_new_tokens": MIGRATED_TOKENS - len(cut), "ignore_eos": True}})).json()
    assert cut + rest["output_ids"] == whole


async def _assert_whole_and_exits_clean(server: KvlifeServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        with anyio.fail_after(BOUND_S):
            while not (report := (await http.get("/debug/memory")).json())["idle"]:
                await anyio.sleep(0.05)
        assert (await http.get("/health")).status_code == 200
    for name, pool in report["pools"].items():
        assert pool["adds_up"] and pool["held"] == 0 and pool["quarantined"] == 0, (name, pool)
        assert pool["free"] + pool["evictable"] == pool["capacity"], (name, pool)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(BOUND_S) == 0
    assert server.events("server.leak_check")[-1]["verdict"] == "clean"

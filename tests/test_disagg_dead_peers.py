"""Dead peers fail fast, bounded by the heartbeat and not by `first_timeout`: the only prefill SIGKILLed
under 16 concurrent long prompts, the decode with no prefill up (requests refused at once, holding no KV;
health not ready), a restarted prefill used again; and a decode SIGKILLed mid-transfer, which the
prefill cleans up within the same bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import anyio
import httpx
import pytest

from disagg_helpers import (SERVE_FAST, SERVE_SMALL, STARTUP, PrefillChild, assert_child_whole, client, remote_config,
                            started_event)
from disagg_helpers import points, spawn  # noqa: F401 - fixtures
from engine import Engine, SamplingParams
from engine.serve.server import running_server
from helpers import run_all, small_config
from states import FinishReason

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
#: 16 distinct prompts of 120 tokens; KV for about 8 of them at once, so the rest wait in QUEUED
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(120)] for i in range(16)]
#: a compute budget far above the heartbeat bound (2 s of silence): a dead peer must not cost it
LOADED = dict(first_timeout=30.0, fence_timeout=45.0, max_running=16)
HELD = 3  # the prefill holds the compute of this request: the ones before it land, the rest wait
SLACK = 3.0  # the loop's iteration, a loaded 2-core machine
#: the decode server of TestDecodeKilled: 8 KiB chunks (several per job); it waits for the held prefill
#: (compute budget and chunk slack) so that it is killed, not timed out
PATIENT = ["--transfer-max-chunk-bytes", "8192", "--transfer-chunk-slack", "5", "--transfer-first-timeout", "30",
           "--fence-timeout", "900"]


class TestPrefillKilledUnderLoad:
    @pytest.mark.asyncio
    async def test_every_request_answers_within_the_heartbeat_bound(self, spawn, points):
        """SIGKILL while 16 long prompts are in flight (some landed, one computing, the rest queued on the
        link or in QUEUED): each answers within the heartbeat bound (TRANSFER_FAILED, or the single engine's
        output if its KV had landed), and the decode ends idle and whole. With no prefill up, a request fails
        in under a second naming why, without entering TRANSFERRING, and health says not ready; a prefill
        restarted on the same address is used again."""
        async with Engine(small_config(max_running=16)) as single:
            want = await run_all(single, PROMPTS, GREEDY.max_new_tokens)
        first = spawn()
        rids = [f"load-{i}" for i in range(len(PROMPTS))]
        points.set(f"hold-compute/{rids[HELD]}")
        async with Engine(remote_config(first.address, **LOADED)) as engine:
            bound = client(engine).settings.dead_peer_bound
            answers: dict[str, tuple] = {}

            async def one(rid: str, prompt: list[int]) -> None:
                final = await engine.complete(prompt, GREEDY, request_id=rid)
                answers[rid] = (final, time.monotonic())

            async with anyio.create_task_group() as tg:
                for rid, prompt in zip(rids, PROMPTS):
                    tg.start_soon(one, rid, prompt)
                await anyio.to_thread.run_sync(points.wait, f"computing/{rids[HELD]}")
                killed = time.monotonic()
                first.kill()
            await engine.wait_idle(5)
            landed = [rid for rid in rids if answers[rid][0].finish_reason is FinishReason.LENGTH]
            failed = [rid for rid in rids if answers[rid][0].finish_reason is FinishReason.TRANSFER_FAILED]
            late = {rid: round(t - killed, 2) for rid, (_, t) in answers.items() if t - killed > bound + SLACK}

            transferring = engine.stats.transitions[("QUEUED", "TRANSFERRING")]
            started = time.monotonic()
            lone = await engine.complete(PROMPTS[0], GREEDY, request_id="lone")
            lone_s = time.monotonic() - started
            refused_into_transferring = engine.stats.transitions[("QUEUED", "TRANSFERRING")] - transferring
            health = engine.health()
            async with running_server(engine) as url, httpx.AsyncClient(base_url=url) as http:
                down = await http.get("/health")

            second = spawn(settings={"bootstrap_port": first.bootstrap})
            await client(engine).wait_links(timeout=STARTUP)
            again = await engine.complete(PROMPTS[5], GREEDY, request_id="again")
            healthy = engine.health()
            async with running_server(engine) as url, httpx.AsyncClient(base_url=url) as http:
                up = await http.get("/health")
        assert not late, f"answers later than the {bound:g} s bound + {SLACK:g} s after the kill: {late}"
        assert len(landed) + len(failed) == len(rids) and rids[HELD] in failed
        assert all(answers[rid][0].token_ids == want[rids.index(rid)] for rid in landed)
        errors = {rid: answers[rid][0].error for rid in failed}
        assert all(f"prefill {first.address} (epoch 1) went down" in e or "no prefill peer is up" in e
                   for e in errors.values()), errors
        assert lone.finish_reason is FinishReason.TRANSFER_FAILED and lone_s < 1.0
        assert "no prefill peer is up" in lone.error and first.address in lone.error
        assert refused_into_transferring == 0  # no KV was pre-allocated for it
        assert (health.healthy, health.reason) == (False, "no_prefill") and first.address in health.detail
        assert down.status_code == 503 and down.json()["reason"] == "no_prefill"
        assert again.finish_reason is FinishReason.LENGTH and again.token_ids == want[5]
        assert healthy.healthy and up.status_code == 200
        assert_child_whole(await anyio.to_thread.run_sync(second.wait_idle))


@pytest.fixture(scope="class")
def shared_prefill(points):
    child = PrefillChild(points)
    try:
        yield child.ready()
    finally:
        child.kill()  # by pid, whatever happened


class TestDecodeKilled:
    @pytest.mark.parametrize("moment", ["computing", "sending"])
    def test_prefill_whole_within_the_bound(self, shared_prefill, points, moment):
        """A decode server SIGKILLed while the prefill computes its request (a second one queued behind it),
        or between two chunks of its KV: the prefill sees the link close, cancels or drops the decode's
        jobs, and is idle with every pool whole within the heartbeat bound."""
        prefill = shared_prefill
        rid = f"orphan-{moment}"
        points.set(f"hold-compute/{rid}" if moment == "computing" else f"hold-send/{rid}/1")
        with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
            decode = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--disaggregation", "decode",
                                       "--prefill", prefill.address, "--port", "0", *SERVE_SMALL, *SERVE_FAST,
                                       *PATIENT], stderr=log, stdout=subprocess.DEVNULL,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"))
            try:
                url = f"http://127.0.0.1:{started_event(log.name, decode)['port']}"
                posts = [threading.Thread(target=_post_ignoring_errors, args=(url, prompt, r), daemon=True)
                         for prompt, r in ((PROMPTS[0], rid), (PROMPTS[1], f"{rid}-next"))]
                posts[0].start()
                points.wait(f"computing/{rid}" if moment == "computing" else f"sending/{rid}/1", timeout=STARTUP)
                posts[1].start()
                points.wait(f"job/{rid}-next", timeout=STARTUP)
                killed = time.monotonic()
                decode.send_signal(signal.SIGKILL)
                decode.wait(10)
                points.set(f"go/{rid}")
                report = prefill.wait_idle(timeout=30)
                elapsed = time.monotonic() - killed
            finally:
                if decode.poll() is None:
                    decode.kill()
                    decode.wait()
            for post in posts:
                post.join(10)
        bound = 4 * 0.5  # the children's keepalive (SERVE_FAST, disagg_helpers.LINK): silence ends a link
        assert elapsed < bound + SLACK, f"the prefill took {elapsed:.2f} s to be whole again"
        assert report["transfer"]["jobs"]["ok"] == 0  # nothing reached the dead decode
        assert all(not link["up"] for link in report["transfer"]["links"].values())
        assert_child_whole(report)


def _post_ignoring_errors(url: str, prompt: list[int], rid: str) -> None:
    body = {"input_ids": prompt, "rid": rid, "sampling_params": {"max_new_tokens": 4}}
    try:
        httpx.post(f"{url}/generate", json=body, timeout=30.0)
    except httpx.HTTPError:
        pass  # the decode died under it

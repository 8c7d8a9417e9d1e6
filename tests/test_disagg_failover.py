"""Many prefill servers and many decode servers (N:M) over kvlife's links: two decodes share two prefills,
jobs spread by load; one prefill SIGKILLed with jobs of both decodes on it (one of them between two
chunks of its KV, partly written): they move to the other prefill and every output (greedy, seeded) is
unchanged."""

from __future__ import annotations

import anyio
import pytest

from disagg_helpers import PointStore, PrefillChild, assert_child_whole, client, remote_config
from engine import Engine, SamplingParams
from helpers import small_config
from states import FinishReason

GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.8, top_k=20, seed=11)
PROMPTS = [[(11 * i + j) % 240 + 5 for j in range(60)] for i in range(8)]
#: jobs wait on held prefills (a compute budget well above that); 64 KiB chunks: 4 per 60-token job; a
#: chunk may wait 5 s, so the job held between two chunks is still in flight when its prefill is killed
LINKED = dict(first_timeout=30.0, chunk_slack=5.0, max_chunk_bytes=64 << 10, fence_timeout=200.0)


@pytest.fixture(scope="module")
def points():
    return PointStore()


@pytest.fixture
def prefills(points):
    children = [PrefillChild(points), PrefillChild(points)]  # both start at once
    try:
        yield [child.ready() for child in children]
    finally:
        for child in children:  # by pid, whatever happened
            child.kill()


def _where(engine, rid: str) -> str:
    """The peer whose link holds `rid`'s job (from the memory report's owners)."""
    owners = engine.memory_report().owners
    return next(name[len("transfer.jobs["):-1] for name, held in owners.items()
                if name.startswith("transfer.jobs[") and any(o.request_id == rid for o in held))


class TestManyToMany:
    @pytest.mark.asyncio
    async def test_prefill_killed_its_decodes_fail_over(self, prefills, points):
        """Two decodes, two prefills: each decode's jobs spread over both, each prefill serves both decodes.
        The prefill holding a job between two chunks is SIGKILLed: its jobs (from both decodes) are re-sent
        to the survivor, every request finishes with the single engine's output, and all end whole."""
        params = [SEEDED if i % 4 == 3 else GREEDY for i in range(len(PROMPTS))]  # two seeded
        async with Engine(small_config()) as single:
            want = [(await single.complete(p, sp)).token_ids for p, sp in zip(PROMPTS, params)]
        rids = [f"nm-{i}" for i in range(len(PROMPTS))]
        points.set(f"hold-send/{rids[0]}/1")
        for rid in rids[1:]:
            points.set(f"hold-compute/{rid}")
        finals: dict[str, object] = {}
        address = {p.address: p for p in prefills}
        async with Engine(remote_config(*address, **LINKED)) as d1, Engine(remote_config(*address, **LINKED)) as d2:
            async def one(engine, i: int) -> None:
                finals[rids[i]] = await engine.complete(PROMPTS[i], params[i], request_id=rids[i])

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, d1, 0)
                await anyio.to_thread.run_sync(points.wait, f"sending/{rids[0]}/1")
                victim = address[_where(d1, rids[0])]
                survivor = next(p for p in prefills if p is not victim)
                for i in range(1, len(rids)):
                    tg.start_soon(one, d1 if i < 4 else d2, i)
                for rid in rids[1:]:
                    await anyio.to_thread.run_sync(points.wait, f"job/{rid}")
                spread = [{peer: link["jobs"] for peer, link in client(d).links().items()} for d in (d1, d2)]
                shared = [sum(link["up"] for link in p.debug()["transfer"]["links"].values()) for p in prefills]
                victim.kill()
                for rid in rids:
                    points.set(f"go/{rid}")
            moved = sum(sum(client(d).stats.snapshot()["failovers"].values()) for d in (d1, d2))
            failed = sum(client(d).stats.snapshot()["jobs"]["failed"] for d in (d1, d2))
        assert all(counts[victim.address] > 0 and counts[survivor.address] > 0 for counts in spread), spread
        assert shared == [2, 2]  # each prefill served both decodes
        assert moved == spread[0][victim.address] + spread[1][victim.address] and failed == 0
        assert {rid: final.finish_reason for rid, final in finals.items()} == dict.fromkeys(rids, FinishReason.LENGTH)
        assert [finals[rid].token_ids for rid in rids] == want
        assert_child_whole(await anyio.to_thread.run_sync(survivor.wait_idle))

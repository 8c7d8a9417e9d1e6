"""kvlife's threads carry their names to the OS (`engine.thread_names`): what `top -H`, `ps -L` and
/proc/<pid>/task/<tid>/comm show, here on Linux, for a thread of its own, the step thread, and a
decode's and a prefill server's link threads."""

from __future__ import annotations

import os
import sys
import threading

import anyio
import pytest

from disagg_helpers import assert_child_whole, os_thread_names, remote_config
from disagg_helpers import points, spawn  # noqa: F401 - fixtures
from engine import Engine, SamplingParams
from engine.thread_names import named_thread, set_native_name
from helpers import assert_pools_whole, small_config

LINUX = sys.platform.startswith("linux")


def _comm(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        return f.read().strip()


def test_a_named_thread_gives_the_os_its_name_and_runs_its_target():
    seen: dict[str, object] = {}

    def target(a: int, b: int) -> None:
        seen["sum"] = a + b
        seen["python"] = threading.current_thread().name
        seen["os"] = _comm(os.getpid(), threading.get_native_id()) if LINUX else None

    thread = named_thread(target, name="kvlife-a-name-past-15-bytes", args=(2, 3))
    assert thread.daemon and not thread.is_alive()  # built, not started
    thread.start()
    thread.join(10)
    assert seen["sum"] == 5 and seen["python"] == "kvlife-a-name-past-15-bytes"
    if LINUX:
        assert seen["os"] == "kvlife-a-name-p"  # the kernel keeps 15 bytes
    else:
        assert not set_native_name("kvlife-x")


def test_a_thread_the_os_cannot_name_still_runs(monkeypatch):
    """No C library to call (or no prctl in it): the thread runs its target unnamed, nothing raised."""
    import ctypes

    import engine.thread_names as names

    def no_library(*args, **kwargs):
        raise OSError("no C library here")

    monkeypatch.setattr(names, "_libc", None)
    monkeypatch.setattr(names, "_unavailable", False)
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    ran = threading.Event()
    thread = named_thread(ran.set, name="kvlife-unnamed")
    thread.start()
    thread.join(10)
    assert ran.is_set() and names._unavailable and not set_native_name("kvlife-x")


@pytest.mark.asyncio
async def test_the_step_thread_is_named_for_the_os():
    seen: set[str] = set()
    async with Engine(small_config(inline_step_tokens=0, inline_step_ms=0)) as engine:
        runner_step = engine.loop.runner.step

        def recording(batch):
            seen.add(_comm(os.getpid(), threading.get_native_id()))
            return runner_step(batch)

        engine.loop.runner.step = recording
        await engine.complete(list(range(5, 25)), SamplingParams(max_new_tokens=3, ignore_eos=True))
        await engine.wait_idle(10)
        assert_pools_whole(engine)
    assert seen == {"kvlife-step"}


@pytest.mark.asyncio
async def test_a_decode_and_a_prefill_server_name_their_link_threads(spawn):  # noqa: F811 - fixture
    child = spawn()
    async with Engine(remote_config(child.address)) as engine:
        final = await engine.complete(list(range(30, 60)), SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert final.finish_reason.name == "LENGTH"
        # NOTE: this link's threads only (named after its peer): another test's may still be winding down
        links = [t for t in threading.enumerate()
                 if t.name.startswith(tuple(f"kvlife-{role}-{child.address}#" for role in ("send", "recv", "write")))]
        assert len(links) == 3, [t.name for t in threading.enumerate()]
        for thread in links:
            assert thread.native_id is not None
            assert _comm(os.getpid(), thread.native_id) == thread.name[:15]
        prefill = os_thread_names(child.pid)
        for prefix in ("kvlife-ctl-", "kvlife-answer-", "kvlife-bootstra"):
            assert any(name.startswith(prefix) for name in prefill), (prefix, prefill)
        await engine.wait_idle(10)
        assert_pools_whole(engine)
    with anyio.fail_after(30):
        assert_child_whole(await anyio.to_thread.run_sync(child.wait_idle))

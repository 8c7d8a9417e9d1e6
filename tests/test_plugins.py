"""Plugin hooks from the config and from the `kvlife.resources` entry point
group are released on every path, in the declared order, and leak-checked."""

from __future__ import annotations


import pytest
import structlog

from engine import Engine, SamplingParams
from helpers import small_config
from plugin_example import LoraSlotHook
from resources import LeakError


class TestConfiguredPlugin:
    @pytest.mark.asyncio
    async def test_plugin_released_after_kv_and_before_timing(self):
        """A plugin declared after="kv" is released after kv and before timing."""
        async with Engine(small_config(resources=(LoraSlotHook,))) as engine:
            with structlog.testing.capture_logs() as logs:
                await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2))
                await engine.wait_idle(5)
            report = engine.check_memory()
        released = [e["resource"] for e in logs if e["event"] == "resource.released"]
        assert released == ["kv", "request_slot", "lora_slot", "timing"]
        assert report.pools["lora_slots"].free == 4

    @pytest.mark.asyncio
    async def test_plugin_exhaustion_queues_requests(self):
        """When the plugin's pool is empty, admission waits; every request still completes."""
        async with Engine(small_config(resources=(LoraSlotHook,))) as engine:
            outs = [engine.generate([i + 1, 2], SamplingParams(max_new_tokens=4)) for i in range(7)]
            finals = [[o async for o in s][-1] for s in outs]
        assert all(f.finish_reason.name == "LENGTH" for f in finals)

    @pytest.mark.asyncio
    async def test_plugin_that_forgets_to_release_is_named(self):
        """A plugin whose release forgets its slot is caught by the leak check, naming the last release."""

        class Forgetful(LoraSlotHook):
            def release(self, request, handle):
                pass

        engine = Engine(small_config(resources=(Forgetful,), leak_check="log"))
        engine._expect_leak = True
        async with engine:
            await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="leaky")
            await engine.wait_idle(5)
            with pytest.raises(LeakError, match=r"lora_slots: free 3 \+ evictable 0 \+ held 0 != capacity 4 .*"
                                                r"latest releases: leaky \(1\)"):
                engine.check_memory()


class TestEntryPointPlugin:
    @pytest.mark.asyncio
    async def test_entry_point_group_is_loaded(self, tmp_path, monkeypatch):
        """A hook published under `kvlife.resources` by an installed distribution is used."""
        dist = tmp_path / "kvlife_lora-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvlife-lora\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text("[kvlife.resources]\nlora = plugin_example:LoraSlotHook\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        async with Engine(small_config(use_entry_points=True)) as engine:
            await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2))
            await engine.wait_idle(5)
            assert "lora_slots" in engine.memory_report().pools

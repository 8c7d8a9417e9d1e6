"""structlog configuration: JSON lines in production, nothing at all below the level."""

from __future__ import annotations

import io
import json

import pytest

from engine import Engine, SamplingParams
from engine.logging import configure_logging
from helpers import small_config


class TestJsonLines:
    @pytest.mark.asyncio
    async def test_transitions_are_json_lines_with_fields(self):
        """At debug level every transition is one JSON object with request_id, src, dst, reason."""
        sink = io.StringIO()
        configure_logging("debug", json=True, stream=sink)
        async with Engine(small_config()) as engine:
            await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="j")
            await engine.wait_idle(5)
        events = [json.loads(line) for line in sink.getvalue().splitlines()]
        transitions = [(e["src"], e["dst"]) for e in events if e["event"] == "request.transition"
                       and e["request_id"] == "j"]
        assert transitions == [(None, "QUEUED"), ("QUEUED", "PREFILLING"), ("PREFILLING", "PREBUILT"),
                               ("PREBUILT", "DECODING"), ("DECODING", "FINISHED"), ("FINISHED", "RELEASED")]
        assert all(e["level"] == "debug" and "timestamp" in e for e in events if e["event"] == "request.transition")


class TestLevels:
    @pytest.mark.asyncio
    async def test_nothing_below_the_level(self):
        """At warning level a normal request writes nothing."""
        sink = io.StringIO()
        configure_logging("warning", stream=sink)
        async with Engine(small_config()) as engine:
            await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2))
            await engine.wait_idle(5)
        assert sink.getvalue() == ""

    def test_unknown_level(self):
        """An unknown level is a clear error."""
        with pytest.raises(ValueError, match="level must be one of"):
            configure_logging("verbose")

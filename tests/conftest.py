"""Shared fixtures. The cheapest leak detector: every Engine a test builds is
checked after the test, and must be idle with every pool whole."""

from __future__ import annotations

import pytest
import structlog
import torch

from engine import engine as engine_module


# NOTE: the tiny model's ops are small; one intra-op thread avoids thread
# hand-off stalls on a 2-core machine, where two threads made the suite ~4x slower.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def default_structlog_config():
    """Every test starts on structlog's defaults (all levels), so capture_logs sees debug
    events even after a test that configured a level filter (the CLI does); marked
    configured, so an Engine keeps them instead of applying its warning-level default."""
    structlog.reset_defaults()
    structlog.configure()
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def assert_engines_leave_pools_whole(monkeypatch):
    """After each test, every engine it built is idle and check_memory() passes."""
    built: list = []
    original_init = engine_module.Engine.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(engine_module.Engine, "__init__", recording_init)
    yield built
    for engine in built:
        if not getattr(engine, "_expect_dead", False):
            assert engine.errored is None, f"the engine's loop died: {engine.errored!r}"
        if engine.config.leak_check == "off" or getattr(engine, "_expect_leak", False):
            continue
        assert engine.idle, f"engine left requests in flight: {engine.loop.requests()}"
        report = engine.check_memory()
        for name, stats in report.pools.items():
            assert stats.held == stats.quarantined, f"{name} holds {stats.held} after the test"


@pytest.fixture
def anyio_backend():
    return "asyncio"

"""Shared fixtures. The cheapest leak detector: every Engine a test builds is
checked after the test, and must be idle with every pool whole."""

from __future__ import annotations

import attrs
import pytest
import structlog
import torch

from engine import engine as engine_module
from engine.runtime import assembly
from helpers import TEST_DEVICE, assert_pools_whole


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
    """After each test, every engine it built is alive, idle and has every pool whole."""
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
        assert_pools_whole(engine, quarantined=None)


@pytest.fixture(autouse=True)
def engines_on_the_test_device(monkeypatch):
    """With KVLIFE_TEST_DEVICE set (docs/gpu.md), every engine part a test builds from a config
    left on the default device ("cpu") is built on the test device instead; unset, nothing changes."""
    if TEST_DEVICE == "cpu":
        yield
        return
    original = assembly._device

    def test_device(config):
        return original(attrs.evolve(config, device=TEST_DEVICE) if config.device == "cpu" else config)

    monkeypatch.setattr(assembly, "_device", test_device)
    yield


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _fail_a_skip(report):
    """A skip becomes a failure: a missing dependency or an unbuilt feature is seen, never silent."""
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, and this suite allows no skips: {reason}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    return _fail_a_skip((yield))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    return _fail_a_skip((yield))

"""The public names each package promises; changing them is a breaking change."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PUBLIC = {
    "engine": {
        "CheckpointError", "Constraint", "Engine", "EngineClosed", "EngineConfig", "EngineDead", "EngineOverloaded", "FinishReason",
        "HealthCheckFailed", "HealthCheckTimeout", "HealthReport", "HiSparseConfig", "InvalidConfig", "InvalidRequest",
        "LOG_LEVELS", "LeakError",
        "MemoryReport", "PluginError", "RequestKind", "RequestOutput", "RequestState", "RequestStream", "SamplingParams",
        "SessionInfo", "SpeculationStats", "SpeculativeConfig", "StructuredConfig", "TokenLogprob",
        "configure_logging", "logging_configuration",
    },
    "states": {
        "HELD_STATES", "LIVE_STATES", "TRANSITIONS", "DoubleRelease", "Fence", "FencePending",
        "ExtendingHook", "FinishReason", "GrowingHook", "Handle", "Hook", "IllegalTransition", "Ledger", "PublishingHook",
        "QuarantiningHook", "Quarantined", "Request", "RequestKind", "RequestMachine", "RequestState",
        "ResourceExhausted", "RollingBackHook", "TokenLogprob", "TransitionObserver", "TrimmingHook",
    },
    "resources": {
        "ENTRY_POINT_GROUP", "CopyFence", "ExtendingHook", "GrowingHook", "HookOrderError", "LeakError", "ManualFence",
        "MemoryReport", "Owner", "PluginContext", "PluginError", "PoolStats", "PoolUsage", "PublishingHook",
        "QuarantiningHook", "ResourceExhausted", "ResourceHook", "ResourceHookProtocol", "RollingBackHook",
        "TrimmingHook",
        "order_hooks", "validate_hook",
    },
}

#: The names docs/architecture.md tells users to rely on.
DOCUMENTED = [
    ("engine", "Engine"), ("engine", "EngineConfig"), ("engine", "SamplingParams"), ("engine", "RequestOutput"),
    ("engine", "InvalidRequest"), ("states", "RequestState"), ("states", "FinishReason"),
    ("states", "IllegalTransition"), ("resources", "LeakError"),
]


class TestPublicNames:
    @pytest.mark.parametrize("package", sorted(PUBLIC))
    def test_all_is_exactly_the_public_names(self, package):
        """`__all__` lists exactly the promised names, with no duplicates."""
        names = importlib.import_module(package).__all__
        assert sorted(names) == sorted(PUBLIC[package]) and len(names) == len(set(names))

    @pytest.mark.parametrize(("package", "name"), [(p, n) for p in sorted(PUBLIC) for n in sorted(PUBLIC[p])])
    def test_every_public_name_resolves(self, package, name):
        """Every name in `__all__` is importable from the package itself."""
        assert getattr(importlib.import_module(package), name) is not None

    @pytest.mark.parametrize(("package", "name"), DOCUMENTED, ids=[f"{p}.{n}" for p, n in DOCUMENTED])
    def test_documented_names_are_public(self, package, name):
        """The names the architecture document promises are in `__all__`."""
        assert name in importlib.import_module(package).__all__

    def test_an_embedder_needs_one_import(self):
        """What an embedding application uses day to day comes from `engine` alone, and is the same object."""
        import engine
        import hisparse
        import resources
        import states

        assert engine.FinishReason is states.FinishReason and engine.RequestState is states.RequestState
        assert engine.LeakError is resources.LeakError and engine.HiSparseConfig is hisparse.HiSparseConfig

    def test_states_stays_free_of_the_other_packages(self):
        """`states` is pure Python: importing it pulls in neither torch nor resources."""
        code = (
            "import sys, states; "
            "print(sorted(m for m in ('torch', 'resources', 'engine', 'hisparse') if m in sys.modules))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]"

"""The public names each package promises; changing them is a breaking change."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PUBLIC = {
    "states": {
        "HELD_STATES", "LIVE_STATES", "TRANSITIONS", "DoubleRelease", "Fence", "FencePending",
        "FinishReason", "Handle", "IllegalTransition", "Request", "RequestKind", "RequestMachine",
        "RequestState",
    },
    "resources": {
        "ENTRY_POINT_GROUP", "KV_PAGES", "REQUEST_SLOTS", "CopyFence", "DoubleFree", "ForeignPage",
        "HookOrderError", "KVBlock", "KVBuffers", "KVHook", "KVPool", "LeakError", "Ledger",
        "ManualFence", "MemoryReport", "Owner", "PageAllocator", "PluginContext", "PoolStats",
        "RadixCache", "RequestSlots", "ResourceExhausted", "ResourceHook", "TimingHook",
        "build_plugin_hooks", "check_memory", "memory_report", "order_hooks",
    },
}

#: The names docs/architecture.md tells users to rely on.
DOCUMENTED = [
    ("states", "RequestState"), ("states", "FinishReason"), ("states", "IllegalTransition"),
    ("resources", "LeakError"),
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

    def test_states_stays_free_of_the_other_packages(self):
        """`states` is pure Python: importing it pulls in neither torch nor resources."""
        code = (
            "import sys, states; "
            "print(sorted(m for m in ('torch', 'resources', 'engine', 'hisparse') if m in sys.modules))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]"

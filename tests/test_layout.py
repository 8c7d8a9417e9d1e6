"""The layout holds: the wheel ships every module, and the architecture doc's
module map names every module."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "states", "resources", "hisparse")


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_the_wheel_holds_every_module(tmp_path):
    """A built wheel contains every module of the four packages (an editable install would hide a gap)."""
    code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300)
    wheel = tmp_path / out.stdout.strip().splitlines()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [m for m in _modules() if m not in names]
    assert not missing, missing


def test_the_module_map_names_every_module():
    """docs/architecture.md's module map lists every module, package by package."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    mapped = set(re.findall(r"`([a-z_]+\.py)`", text))
    missing = [m for m in _modules() if Path(m).name != "__init__.py" and Path(m).name not in mapped]
    assert not missing, f"docs/architecture.md's module map lacks {missing}"


def test_web_libraries_are_imported_only_by_the_server():
    """Every module outside engine/serve and engine/cli imports without starlette, uvicorn or prometheus_client."""
    modules = [m.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for m in _modules()
               if not m.startswith(("engine/serve/", "engine/cli/"))]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in ('starlette', 'uvicorn', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]"

"""The suite's own rules hold: every warning fails its test, and no file is over 400 lines."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400
CHECKED = ("engine", "states", "resources", "hisparse", "benchmarks", "tests")


@pytest.mark.parametrize("category", [DeprecationWarning, ResourceWarning, UserWarning, RuntimeWarning])
def test_a_warning_is_an_error(category):
    """pyproject's filterwarnings turns every warning category into an error, ResourceWarning included."""
    with pytest.raises(category, match="kvlife's own"):
        warnings.warn("a warning from kvlife's own code", category, stacklevel=1)


def test_no_file_is_over_400_lines():
    """Every Python file of the packages, the benchmarks and the tests stays within 400 lines."""
    long = {str(p.relative_to(ROOT)): n for pkg in CHECKED for p in sorted((ROOT / pkg).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along a concept): {long}"

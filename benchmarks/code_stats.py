"""Code shape per package: lines, files over 300 lines, and explicit `Any` annotations.

    python benchmarks/code_stats.py [--root DIR] [--out bench-results/code_stats.json]

Packages: states, resources, hisparse, and engine split into its rooms
(engine = its top-level modules: config, errors, engine.py, prefill_server.py, ...).
An explicit `Any` is a use of the name `Any` (or `typing.Any`) anywhere in a
module, its import not counted. tests/test_any_ratchet.py holds the counts to
recorded ceilings that may only go down.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from pathlib import Path

PACKAGES = ("states", "resources", "hisparse", "engine")
ROOMS = ("model", "disagg", "runtime", "serve", "cli", "structured", "kv_events")


def package_of(rel: str) -> str:
    """'engine/runtime/loop.py' -> 'engine.runtime'; 'engine/config.py' -> 'engine'; 'states/x.py' -> 'states'."""
    parts = rel.split("/")
    if parts[0] == "engine" and len(parts) > 2 and parts[1] in ROOMS:
        return f"engine.{parts[1]}"
    return parts[0]


def explicit_any(source: str) -> int:
    tree = ast.parse(source)
    return sum(1 for node in ast.walk(tree) if (isinstance(node, ast.Name) and node.id == "Any")
               or (isinstance(node, ast.Attribute) and node.attr == "Any"))


def code_stats(root: Path) -> dict[str, object]:
    lines: Counter[str] = Counter()
    anys: Counter[str] = Counter()
    files: Counter[str] = Counter()
    big: list[tuple[str, int]] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            n = len(text.splitlines())
            key = package_of(rel)
            lines[key] += n
            files[key] += 1
            anys[key] += explicit_any(text)
            if n > 300:
                big.append((rel, n))
    return {"lines": dict(sorted(lines.items())), "files": dict(sorted(files.items())),
            "explicit_any": dict(sorted(anys.items())), "over_300_lines": big}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    stats = code_stats(Path(args.root))
    print(f"{'package':16} {'files':>5} {'lines':>6} {'Any':>4}")
    for key, n in stats["lines"].items():  # type: ignore[attr-defined]
        print(f"{key:16} {stats['files'][key]:>5} {n:>6} {stats['explicit_any'][key]:>4}")  # type: ignore[index]
    print("over 300 lines:", ", ".join(f"{rel} ({n})" for rel, n in stats["over_300_lines"]))  # type: ignore[attr-defined]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

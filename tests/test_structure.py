"""What the design promises about the code's shape, read from the source (AST), so a change that
breaks it fails here, not in review:

- only hooks free: a pool's freeing calls appear only in a hook's declared members
  (`acquire`'s rollback, `release`, `grow`, `trim`, `publish`, `extend`, `rollback`, `quarantine`) or inside a
  pool's own implementation;
- one writer of a request's progress (`kv_len`, output tokens and logprobs, token times):
  the step applier; fences are added through the machine only; one object moves requests
  through the machine: the runtime's gateway;
- the machine reads no hook member by name (no getattr in states/);
- imports point one way (states < resources < hisparse < engine.{config, model, ...} <
  engine.disagg < engine.runtime < Engine and the prefill server < engine.{serve, cli}),
  with no import cycle, and serve and cli use only public names (engine.structured, the grammars,
  engine.kv_events, the prefix cache's events, and engine.speculative, the proposers and the
  verify step, sit beside engine.model).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("states", "resources", "hisparse", "engine")

#: calls that give pool memory back (or drop a reference that frees it)
FREEING = {"free", "free_chunks", "give", "evict_pages", "unreference"}
#: the hook members that may free: the declared ones of resources.contract (and acquire's rollback)
HOOK_MEMBERS = {"acquire", "release", "grow", "trim", "publish", "extend", "rollback", "quarantine"}
#: freeing outside a hook or a pool, each with its reason
FREEING_EXCEPTIONS = {
    # a link's receive buffers: taken and given back by the link's own threads within one chunk's
    # bound, held for no request (the decode's `transfer.staging`; no request handle owns them)
    ("engine/disagg/decode/link_writing.py", "LinkWriting", "_drain"),
    ("engine/disagg/decode/link_writing.py", "LinkWriting", "_write"),
}
#: a request's progress: written only by the step applier
PROGRESS = {"kv_len", "first_token_time", "last_token_time"}
PROGRESS_LISTS = {"output_token_ids", "output_logprobs"}
WRITER = "engine/runtime/step_applier.py"


def _modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path, ast.parse(path.read_text())


class _Scopes(ast.NodeVisitor):
    """Visits every node with its enclosing class and function."""

    def __init__(self) -> None:
        self.classes: list[ast.ClassDef] = []
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self.found: list[tuple[int, str, str | None, str | None]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    @property
    def where(self) -> tuple[ast.ClassDef | None, str | None]:
        return (self.classes[-1] if self.classes else None), (self.functions[-1].name if self.functions else None)


def _methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_only_hooks_free():
    """Pool memory is given back only by a hook's declared members, or inside the pool's own code."""
    offenders = []
    for rel, _path, tree in _modules():
        scopes = _Scopes()

        def visit_call(node: ast.Call, scopes: _Scopes = scopes, rel: str = rel) -> None:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in FREEING:
                cls, fn = scopes.where
                methods = _methods(cls) if cls is not None else set()
                hook_class = cls is not None and ("release" in methods or any(
                    isinstance(b, ast.Name) and b.id.endswith("Hook") for b in cls.bases))
                is_hook = hook_class and fn in HOOK_MEMBERS
                is_pool = bool(methods & (FREEING | {"stats", "evict"}))  # the pool's own implementation
                if not (is_hook or is_pool or (rel, cls.name if cls else None, fn) in FREEING_EXCEPTIONS):
                    offenders.append(f"{rel}:{node.lineno} {func.attr}() in {cls.name if cls else '-'}.{fn}")
            scopes.generic_visit(node)

        scopes.visit_Call = visit_call  # type: ignore[method-assign]
        scopes.visit(tree)
    assert not offenders, offenders


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def test_the_step_applier_is_the_one_writer_of_progress():
    """kv_len, output tokens and logprobs, and token times are written in the step applier only."""
    writers = []
    for rel, _path, tree in _modules():
        for node in ast.walk(tree):
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and target.attr in PROGRESS | PROGRESS_LISTS:
                    writers.append(f"{rel}:{node.lineno} {target.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in PROGRESS_LISTS
                    and node.func.attr in {"append", "extend", "pop", "insert", "clear", "remove"}):
                writers.append(f"{rel}:{node.lineno} {node.func.value.attr}.{node.func.attr}")
    outside = [w for w in writers if not w.startswith(WRITER)]
    assert writers and not outside, outside


def test_fences_are_added_through_the_machine():
    """A request's fences change only in the machine (a hook hands its fences back with its handle, a step
    with its output)."""
    offenders = []
    for rel, _path, tree in _modules():
        for node in ast.walk(tree):
            for target in _targets(node):
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) \
                        and target.value.attr == "fences" and rel != "states/machine.py":
                    offenders.append(f"{rel}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "fences"
                    and not (isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "self")
                    and node.func.attr in {"append", "extend", "insert", "clear", "remove", "pop"}
                    and rel != "states/machine.py"):
                offenders.append(f"{rel}:{node.lineno} fences.{node.func.attr}")
    assert not offenders, offenders


def test_one_gateway_moves_requests_through_the_machine():
    """Outside `states`, only the runtime's gateway calls the machine's moves (start, advance, finish,
    release) and its other per-request calls (growth, publishing, fences)."""
    calls = {"start", "advance", "finish", "try_release", "reap_quarantine", "grow", "publish", "add_fence",
             "prune_fences"}
    offenders = []
    for rel, _path, tree in _modules():
        if rel.startswith("states/") or rel == "engine/runtime/gateway.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls:
                owner = node.func.value
                name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) \
                    else None
                if name == "machine":
                    offenders.append(f"{rel}:{node.lineno} machine.{node.func.attr}")
    assert not offenders, offenders


def test_the_machine_reads_no_hook_member_by_name():
    """The machine calls hooks through their protocols (states.protocols), never getattr/hasattr by name."""
    calls = [f"{rel}:{node.lineno}" for rel, _path, tree in _modules() if rel == "states/machine.py"
             for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in {"getattr", "hasattr", "setattr"}]
    assert not calls, calls


# ---------------------------------------------------------------- layering
def _layer(module: str) -> float | None:
    parts = module.split(".")
    if parts[0] in ("states", "resources", "hisparse"):
        return ("states", "resources", "hisparse").index(parts[0])
    if parts[0] != "engine":
        return None
    if len(parts) == 1:
        return 6.5  # the package's facade (engine/__init__.py): Engine and the public names
    sub = parts[1]
    if sub in ("config", "model", "errors", "outputs", "logging", "stream", "testing", "structured", "kv_events",
               "speculative", "thread_names"):
        return 3
    return {"disagg": 4, "runtime": 5, "engine": 6, "prefill_server": 6, "serve": 7, "cli": 7}[sub]


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of every import, module-level, TYPE_CHECKING or inside a function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def test_imports_point_one_way():
    """No module imports one of a layer above its own, however it imports it."""
    upward = []
    for rel, _path, tree in _modules():
        mine = _layer(_module_name(rel))
        for line, target, _names in _imports(tree):
            theirs = _layer(target)
            if theirs is not None and mine is not None and theirs > mine:
                upward.append(f"{rel}:{line} imports {target}")
    assert not upward, upward


def test_no_import_cycles():
    """The import graph of the four packages has no cycle (module-level, TYPE_CHECKING and lazy imports)."""
    modules = {_module_name(rel): tree for rel, _path, tree in _modules()}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, tree in modules.items():
        for _line, target, names in _imports(tree):
            for dep in [resolve(target), *(resolve(f"{target}.{n}") for n in names)]:
                if dep is not None and dep != module and not module.startswith(f"{dep}."):
                    graph[module].add(dep)
    cycles, done, path = [], set(), []

    def visit(node: str) -> None:
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        path.append(node)
        for dep in sorted(graph[node]):
            visit(dep)
        path.pop()
        done.add(node)

    for module in sorted(graph):
        visit(module)
    assert not cycles, cycles


def test_serve_and_cli_use_public_names_only():
    """What engine.serve and engine.cli import from the rest is in a package's `__all__`."""
    public: set[str] = set()
    for package in ("engine", "engine.disagg", "engine.kv_events", "resources", "states", "hisparse"):
        public |= set(importlib.import_module(package).__all__)
    private = []
    for rel, _path, tree in _modules():
        if not rel.startswith(("engine/serve/", "engine/cli/")):
            continue
        for line, target, names in _imports(tree):
            if _layer(target) is None or target.startswith(("engine.serve", "engine.cli")):
                continue
            if not names or any(n not in public for n in names):
                private.append(f"{rel}:{line} {target} {[n for n in names if n not in public]}")
    assert not private, private

"""The resource-hook contract: declarations, the release order, handles, plugins."""

from __future__ import annotations

import gc
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resources.plugins
from resources import HookOrderError, PluginContext, PluginError, ResourceHook, ResourceHookProtocol, order_hooks
from resources.contract import REQUIRED_MEMBERS, validate_hook
from resources.plugins import build_plugin_hooks
from states import DoubleRelease, FinishReason, Handle, Request, RequestMachine, RequestState

S = RequestState


def _make_hook(name: str, *, before=(), after=(), **attrs) -> ResourceHook:
    hook = ResourceHook()
    hook.name, hook.before, hook.after = name, tuple(before), tuple(after)
    for key, value in attrs.items():
        setattr(hook, key, value)
    return hook


def _names(hooks) -> list[str]:
    return [h.name for h in hooks]


def _assert_respects(ordered, hooks) -> None:
    pos = {h.name: i for i, h in enumerate(ordered)}
    for h in hooks:
        assert all(pos[h.name] < pos[o] for o in h.before), (h.name, h.before)
        assert all(pos[o] < pos[h.name] for o in h.after), (h.name, h.after)


def _smallest_topological(hooks) -> list[str]:
    """Reference: repeatedly take the earliest-registered hook whose predecessors are placed."""
    preds = {h.name: set(h.after) for h in hooks}
    for h in hooks:
        for o in h.before:
            preds[o].add(h.name)
    out: list[str] = []
    while len(out) < len(hooks):
        out.append(next(h.name for h in hooks if h.name not in out and preds[h.name] <= set(out)))
    return out


@st.composite
def _acyclic_hooks(draw):
    """Hooks with random before/after constraints that a hidden order satisfies."""
    n = draw(st.integers(1, 7))
    names = [f"h{i}" for i in range(n)]
    hidden = draw(st.permutations(names))
    before = {name: [] for name in names}
    after = {name: [] for name in names}
    for i in range(n):
        for j in range(i + 1, n):
            kind = draw(st.sampled_from(["none", "none", "before", "after"]))
            if kind == "before":
                before[hidden[i]].append(hidden[j])
            elif kind == "after":
                after[hidden[j]].append(hidden[i])
    return [_make_hook(name, before=before[name], after=after[name]) for name in names]


class TestOrderHooks:
    def test_no_constraints_keeps_registration_order(self):
        """Ties are broken by registration order."""
        hooks = [_make_hook(n) for n in "cab"]
        assert _names(order_hooks(hooks)) == ["c", "a", "b"]

    def test_before_and_after_move_hooks(self):
        """`before` and `after` override registration order, the rest stays put."""
        hooks = [
            _make_hook("timing", after=("mm",)),
            _make_hook("kv"),
            _make_hook("mm", after=("kv",)),
            _make_hook("hisparse", before=("kv",)),
            _make_hook("moe", before=("hisparse",)),
        ]
        assert _names(order_hooks(hooks)) == ["moe", "hisparse", "kv", "mm", "timing"]

    @settings(max_examples=150, deadline=None)
    @given(_acyclic_hooks())
    def test_order_respects_constraints_deterministically(self, hooks):
        """Any satisfiable constraints give the earliest-registered-first topological order, every time."""
        ordered = order_hooks(hooks)
        _assert_respects(ordered, hooks)
        assert _names(ordered) == _smallest_topological(hooks)
        assert _names(order_hooks(hooks)) == _names(ordered)
        assert _names(order_hooks(list(ordered))) == _names(ordered)

    @pytest.mark.parametrize(
        "hooks",
        [
            [_make_hook("a", before=("a",))],
            [_make_hook("a", before=("b",)), _make_hook("b", before=("a",))],
            [_make_hook("a", after=("c",)), _make_hook("b", after=("a",)), _make_hook("c", after=("b",))],
            [_make_hook("a", before=("b",)), _make_hook("b"), _make_hook("c", after=("b",), before=("a",))],
        ],
        ids=["self", "two", "three-after", "mixed"],
    )
    def test_cycle_raises(self, hooks):
        """A before/after cycle is refused at registration, naming the hooks in it."""
        with pytest.raises(HookOrderError, match="cycle") as info:
            order_hooks(hooks)
        assert "'a'" in str(info.value)

    @pytest.mark.parametrize("field", ["before", "after"])
    def test_unknown_name_raises(self, field):
        """A constraint on a hook that is not registered is an error naming both."""
        with pytest.raises(HookOrderError, match="'kv' refers to unknown hook 'hisparse'"):
            order_hooks([_make_hook("kv", **{field: ("hisparse",)}), _make_hook("timing")])

    def test_duplicate_name_raises(self):
        """Two hooks cannot share a name: it keys the request's handles."""
        with pytest.raises(HookOrderError, match="two resource hooks are named 'kv'"):
            order_hooks([_make_hook("kv"), _make_hook("timing"), _make_hook("kv")])

    def test_empty_is_fine(self):
        """An engine with no hooks has an empty order."""
        assert order_hooks([]) == []


class TestValidateHook:
    @pytest.mark.parametrize(
        ("attrs", "message"),
        [
            ({"name": ""}, "non-empty string name"),
            ({"name": 7}, "non-empty string name"),
            ({"scope": frozenset(S)}, "RELEASED cannot be in a scope"),
            ({"acquire_on": frozenset({S.QUEUED}), "scope": frozenset({S.DECODING})}, "subset of scope"),
            ({"acquire_on": frozenset({S.FINISHED})}, "cannot acquire on FINISHED"),
            ({"scope": {"QUEUED"}}, "scope must be a set of RequestState"),
            ({"before": "kv"}, "before must be a tuple of hook names"),
            ({"pool": 3}, "pool must be None or a non-empty string"),
            ({"release": None}, "release must be callable"),
        ],
        ids=["empty-name", "int-name", "released-in-scope", "acquire-outside-scope", "acquire-on-finished",
             "scope-of-strings", "before-a-string", "int-pool", "release-not-callable"],
    )
    def test_bad_declarations_raise(self, attrs, message):
        """A hook whose declaration breaks the contract is refused before any request runs."""
        hook = _make_hook("x")
        for key, value in attrs.items():
            setattr(hook, key, value)
        with pytest.raises(HookOrderError, match=message):
            order_hooks([hook])

    @pytest.mark.parametrize("missing", REQUIRED_MEMBERS)
    def test_missing_attribute_raises(self, missing):
        """Duck-typed hooks must have every member the protocol declares."""
        spec = {"name": "x", "acquire_on": frozenset(), "scope": frozenset(), "before": (), "after": (),
                "pool": None, "acquire": lambda self, r, into: None, "release": lambda self, r, h: None}
        del spec[missing]
        hook = type("Partial", (), spec)()
        with pytest.raises(HookOrderError, match=repr(missing)):
            validate_hook(hook)

    def test_the_checked_members_are_the_protocols(self):
        """validate_hook checks exactly the members ResourceHookProtocol declares."""
        declared = {name for name, member in vars(ResourceHookProtocol).items()
                    if isinstance(member, property) or (callable(member) and not name.startswith("_"))}
        assert set(REQUIRED_MEMBERS) == declared

    def test_a_duck_typed_hook_needs_no_base_class(self):
        """An object with the protocol's members (no quarantine, no grow) is a valid hook."""
        spec = {"name": "x", "acquire_on": frozenset(), "scope": frozenset({S.QUEUED}), "before": (), "after": (),
                "pool": None, "acquire": lambda self, r, into: None, "release": lambda self, r, h: None}
        hook = type("Duck", (), spec)()
        assert order_hooks([hook]) == [hook] and isinstance(hook, ResourceHookProtocol)


class TestResourceHookBase:
    def test_a_hook_that_needs_nothing_holds_nothing(self):
        """acquire returning None leaves no handle on the request."""
        hook = _make_hook("noop", acquire_on=frozenset({S.QUEUED}))
        machine = RequestMachine([hook])
        req = Request("r1", [1], None)
        machine.start(req)
        assert req.handles == {}
        machine.finish(req, FinishReason.STOP)
        assert machine.try_release(req)

    def test_base_hook_holds_no_state_and_names_itself(self):
        """The base class needs no __init__ call: a subclass that skips super().__init__() still works."""
        class NoSuper(ResourceHook):
            name = "x"

            def __init__(self) -> None:
                pass

        assert order_hooks([NoSuper()])[0].name == "x" and repr(NoSuper()) == "<NoSuper 'x'>"


def _forget(obj) -> None:
    del obj
    gc.collect()


class TestHandleLifetime:
    def test_garbage_collected_while_held_warns(self):
        """A held handle that is dropped emits ResourceWarning, like an unclosed file."""
        with pytest.warns(ResourceWarning, match="garbage-collected while still held"):
            _forget(Handle("kv", "r1", amount=3))

    @pytest.mark.parametrize("mark", ["mark_released", "mark_quarantined"])
    def test_finished_handles_are_silent(self, mark):
        """Released and quarantined handles are collected without a warning."""
        handle = Handle("kv", "r1")
        getattr(handle, mark)()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _forget(handle)
        assert caught == []

    @pytest.mark.parametrize(("first", "second"), [("mark_released", "mark_released"),
                                                   ("mark_released", "mark_quarantined"),
                                                   ("mark_quarantined", "mark_quarantined")])
    def test_a_handle_ends_once(self, first, second):
        """After release, any second ending raises DoubleRelease; a quarantine happens once."""
        handle = Handle("kv", "r1")
        getattr(handle, first)()
        status = handle.status
        with pytest.raises(DoubleRelease):
            getattr(handle, second)()
        assert handle.status == status and not handle.held


def test_a_quarantined_handle_is_released_once_its_fence_is_done():
    """Quarantine ends in one release (when the late copy completes); a second one raises."""
    handle = Handle("kv", "r1")
    handle.mark_quarantined()
    handle.mark_released()
    assert handle.was_quarantined and handle.status == Handle.RELEASED
    with pytest.raises(DoubleRelease):
        handle.mark_released()


class _EntryPoint:
    value = "test:factory"

    def __init__(self, name: str, target) -> None:
        self.name, self._target = name, target

    def load(self):
        return self._target


class TestPlugins:
    def _context(self) -> PluginContext:
        return PluginContext(device="cpu", config=None)

    def test_instances_and_factories(self):
        """A configured hook is used as is; a factory is called with the context."""
        ctx = self._context()
        given_hook = _make_hook("lease")
        seen = []

        def factory(context):
            seen.append(context)
            return _make_hook("made")

        hooks = build_plugin_hooks([given_hook, factory], ctx, use_entry_points=False)
        assert hooks[0] is given_hook and _names(hooks) == ["lease", "made"] and seen == [ctx]

    def test_entry_points_come_after_config_sorted_by_name(self, monkeypatch):
        """Entry-point factories load after configured hooks, in entry-point name order."""
        eps = [_EntryPoint("zeta", lambda c: _make_hook("z")), _EntryPoint("alpha", lambda c: _make_hook("a"))]
        fake = lambda group: eps if group == "kvlife.resources" else []  # noqa: E731
        monkeypatch.setattr(resources.plugins, "entry_points", fake)
        hooks = build_plugin_hooks([_make_hook("cfg")], self._context())
        assert _names(hooks) == ["cfg", "a", "z"]

    def test_a_broken_entry_point_is_named(self, monkeypatch):
        """An entry point that fails to load raises PluginError naming it, not a bare traceback."""
        class Broken(_EntryPoint):
            value = "nowhere:hook"

            def load(self):
                raise ImportError("No module named 'nowhere'")

        monkeypatch.setattr(resources.plugins, "entry_points", lambda group: [Broken("gpu_lease", None)])
        with pytest.raises(PluginError, match="plugin entry point 'gpu_lease' \\(nowhere:hook\\) failed to load"):
            build_plugin_hooks([], self._context())

    def test_a_factory_that_raises_is_named(self):
        """A factory that raises is reported with the plugin it came from."""
        def factory(context):
            raise RuntimeError("no GPU lease service")

        with pytest.raises(PluginError, match="failed to build its hook: RuntimeError"):
            build_plugin_hooks([factory], self._context(), use_entry_points=False)

"""KVPool + KVHook through the request machine: admission, growth, release, leaks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from resources import ManualFence, ResourceExhausted, ResourceHook
from resources.kv_hook import KVHook
from resources.kv_pool import KV_PAGES, KVPool
from resources.ledger import LeakError, Ledger, check_memory, memory_report
from resources.request_slots import REQUEST_SLOTS, RequestSlotHook
from helpers import Clock
from states import DoubleRelease, FinishReason, Request, RequestMachine, RequestState

S = RequestState
PS = 2


class _Full(ResourceHook):
    """A hook acquired after KV on admission whose pool is always full."""

    name = "hisparse"
    acquire_on = frozenset({S.PREFILLING})

    def acquire(self, request, into):
        raise ResourceExhausted("no device buffer")


def _make_kv(num_pages=9, max_running=2, max_context=32, extra_hooks=(), clock=None):
    ledger = Ledger()
    kv = KVPool(num_pages=num_pages, page_size=PS, max_running=max_running, max_context=max_context,
                device="cpu")
    hook = KVHook(kv)
    machine = RequestMachine([*extra_hooks, hook, RequestSlotHook(kv.slots)], ledger=ledger,
                             **({"clock": clock} if clock else {}))
    return kv, hook, machine, ledger


def _pools(kv: KVPool) -> list:
    return [kv, kv.slots]


def _stats(kv: KVPool, ledger: Ledger) -> dict:
    return memory_report(_pools(kv), ledger, idle=False).pools


def _snapshot(kv: KVPool, ledger: Ledger) -> tuple:
    radix = (kv.radix.evictable_pages, kv.radix.protected_pages) if kv.radix else None
    return (_stats(kv, ledger), kv.allocator._stack[: kv.allocator.num_free].tolist(), kv.slots.num_free, radix,
            ledger.held(KV_PAGES), ledger.held(REQUEST_SLOTS), dict(kv.prefix_locks))


def _check(kv: KVPool, ledger: Ledger, *, idle: bool = False):
    """check_memory over the KV pool and its slots: raises LeakError if a pool does not add up (or, idle, holds)."""
    return check_memory(_pools(kv), ledger, idle=idle)


def _admit(machine, rid, tokens, into=S.PREFILLING) -> Request:
    """Admit as the runtime does: the machine moves it, then (the step applier's job) its progress
    starts at the prefix the KV hook found cached."""
    req = Request(rid, list(tokens), None)
    machine.start(req)
    machine.advance(req, into)
    req.kv_len = KVHook.cached_tokens(req)
    return req


def _prefill(req: Request, machine: RequestMachine, next_token: int = 1) -> None:
    req.kv_len = req.num_tokens
    req.output_token_ids.append(next_token)
    machine.advance(req, S.PREBUILT)
    machine.advance(req, S.DECODING)


def _release(machine, req, reason=FinishReason.STOP) -> None:
    machine.finish(req, reason)
    assert machine.try_release(req)


def _block(req: Request):
    return req.handles["kv"].payload


class TestAdmission:
    def test_acquire_takes_a_slot_and_pages_and_writes_locations(self):
        """Admission holds one slot and enough pages; req_to_token maps each token to its page."""
        kv, _, machine, ledger = _make_kv()
        req = _admit(machine, "a", [5, 6, 7])
        block = _block(req)
        assert len(block.pages) == 2 and req.kv_len == 0
        row = kv.slots.req_to_token[block.slot, :3].tolist()
        assert row == [block.pages[i // PS] * PS + i % PS for i in range(3)]
        assert (ledger.holding(KV_PAGES, req), ledger.holding(REQUEST_SLOTS, req)) == (2, 1)
        _check(kv, ledger)
        _release(machine, req, FinishReason.ABORT)

    def test_cached_prefix_is_matched_locked_and_shared(self):
        """A second request reuses the first's cached whole pages, all but the last token."""
        kv, _, machine, ledger = _make_kv()
        first = _admit(machine, "a", [1, 2, 3, 4, 5])
        _prefill(first, machine)
        shared = _block(first).pages[:2]
        _release(machine, first)
        second = _admit(machine, "b", [1, 2, 3, 4, 9])
        assert _block(second).pages[:2] == shared and _block(second).num_prefix_pages == 2
        assert second.kv_len == 4 and kv.radix.protected_pages == 2
        assert ledger.holding(KV_PAGES, second) == 1  # the prefix is the cache's, not the request's
        _release(machine, second, FinishReason.ABORT)
        assert kv.radix.protected_pages == 0
        _check(kv, ledger, idle=True)

    def test_transfer_preallocates_without_matching(self):
        """The decode role pre-allocates every page to receive a transfer."""
        kv, _, machine, ledger = _make_kv()
        first = _admit(machine, "a", [1, 2, 3, 4, 5])
        _prefill(first, machine)
        _release(machine, first)
        req = _admit(machine, "b", [1, 2, 3, 4, 5], into=S.TRANSFERRING)
        assert _block(req).num_prefix_pages == 0 and ledger.holding(KV_PAGES, req) == 3
        _release(machine, req, FinishReason.TRANSFER_FAILED)
        _check(kv, ledger, idle=True)

    @pytest.mark.parametrize("short", ["slots", "pages"])
    def test_exhaustion_raises_and_changes_nothing(self, short):
        """Without a slot or enough pages admission raises; the request stays QUEUED."""
        kv, _, machine, ledger = _make_kv(max_running=1 if short == "slots" else 2)
        holder = _admit(machine, "a", [1] * (2 if short == "slots" else 15))
        req = Request("b", [2] * 5, None)
        machine.start(req)
        before = _snapshot(kv, ledger)
        with pytest.raises(ResourceExhausted):
            machine.advance(req, S.PREFILLING)
        assert req.state is S.QUEUED and "kv" not in req.handles and _snapshot(kv, ledger) == before
        _release(machine, holder, FinishReason.ABORT)
        machine.advance(req, S.PREFILLING)
        _release(machine, req, FinishReason.ABORT)
        _check(kv, ledger, idle=True)

    def test_failed_later_acquisition_rolls_kv_back(self):
        """A hook failing after KV on admission leaves pages, slot and prefix lock as before."""
        kv, _, machine, ledger = _make_kv(extra_hooks=[_Full()])
        seed = RequestMachine([KVHook(kv), RequestSlotHook(kv.slots)])
        first = _admit(seed, "a", [1, 2, 3, 4, 5])
        _prefill(first, seed)
        _release(seed, first)
        req = Request("b", [1, 2, 3, 4, 5], None)
        machine.start(req)
        before = _snapshot(kv, ledger)
        with pytest.raises(ResourceExhausted, match="no device buffer"):
            machine.advance(req, S.PREFILLING)
        assert req.state is S.QUEUED and req.handles == {} and _snapshot(kv, ledger) == before
        _release(machine, req, FinishReason.ABORT)


class TestGrow:
    def test_grow_adds_a_page_at_each_boundary(self):
        """Decoding past a page boundary allocates exactly one more page."""
        kv, hook, machine, ledger = _make_kv()
        req = _admit(machine, "a", [1, 2, 3])
        _prefill(req, machine)
        assert machine.grow(req, 4) and len(_block(req).pages) == 2
        assert machine.grow(req, 5) and len(_block(req).pages) == 3
        assert req.handles["kv"].amount == 3 and ledger.holding(KV_PAGES, req) == 3
        assert kv.slots.req_to_token[_block(req).slot, 4] == _block(req).pages[2] * PS
        _release(machine, req)

    def test_grow_fails_whole_when_the_pool_is_short(self):
        """A growth the pool cannot cover returns False and changes nothing."""
        kv, hook, machine, ledger = _make_kv(num_pages=3)
        req = _admit(machine, "a", [1, 2, 3, 4])
        _prefill(req, machine)
        before = _snapshot(kv, ledger)
        assert machine.grow(req, 5) is False and _snapshot(kv, ledger) == before
        _release(machine, req)


#: (path after admission, kv_len set before finishing, pages expected in the cache afterwards)
FINISH_PATHS = {
    "abort-mid-prefill": ([], 0, 0),
    "prefill-partial": ([], 3, 1),
    "prebuilt-first-token": ([S.PREBUILT], 5, 2),
    "decoding": ([S.PREBUILT, S.DECODING], 5, 2),
    "staging": ([S.PREBUILT, S.STAGING], 5, 2),
    "retracted": ([S.PREBUILT, S.DECODING, S.RETRACTED], 5, 2),
    "transfer-failed": (["transfer"], 0, 0),
}


class TestRelease:
    @pytest.mark.parametrize("path", list(FINISH_PATHS), ids=list(FINISH_PATHS))
    def test_every_path_returns_every_page_and_caches_only_complete_kv(self, path):
        """Reaching RELEASED frees slot and pages; only whole pages of complete KV stay cached."""
        steps, kv_len, cached = FINISH_PATHS[path]
        kv, _, machine, ledger = _make_kv()
        into = S.TRANSFERRING if steps == ["transfer"] else S.PREFILLING
        req = _admit(machine, "a", [1, 2, 3, 4, 5], into=into)
        req.kv_len = kv_len
        for dst in (s for s in steps if s != "transfer"):
            machine.advance(req, dst)
        _release(machine, req, FinishReason.ABORT)
        report = _check(kv, ledger, idle=True)
        assert report.pools[KV_PAGES].held == 0 and report.pools[REQUEST_SLOTS].free == 2
        assert kv.radix.evictable_pages == cached
        assert kv.radix.match([1, 2, 3, 4, 5])[0] == kv.radix.match([1, 2, 3, 4, 5, 6])[0][:cached]

    def test_second_release_is_refused_before_the_pool(self):
        """Releasing the KV handle again raises DoubleRelease and frees nothing."""
        kv, hook, machine, ledger = _make_kv()
        req = _admit(machine, "a", [1, 2, 3])
        handle = req.handles["kv"]
        _release(machine, req, FinishReason.ABORT)
        before = _snapshot(kv, ledger)
        with pytest.raises(DoubleRelease):
            machine._release_handle(req, hook, handle)
        assert _snapshot(kv, ledger) == before

    def test_live_request_at_idle_is_named(self):
        """A request still holding KV when the engine calls itself idle is named in the LeakError."""
        kv, _, machine, ledger = _make_kv()
        req = _admit(machine, "req-42", [1, 2, 3])
        _prefill(req, machine)
        with pytest.raises(LeakError) as info:
            _check(kv, ledger, idle=True)
        assert "kv_pages: 2 pages held while idle" in str(info.value)
        assert "req-42 (DECODING, -) 2" in str(info.value) and "request_slots: 1 slots" in str(info.value)
        _release(machine, req)


class TestFences:
    @pytest.mark.parametrize("meets_deadline", [True, False], ids=["meets", "misses"])
    def test_fence_deadline(self, meets_deadline):
        """A fence that completes lets pages go; one that misses its deadline quarantines them."""
        clock = Clock()
        kv, hook, machine, ledger = _make_kv(clock=clock)
        req = _admit(machine, "req-q", [1, 2, 3, 4, 5])
        _prefill(req, machine)
        fence = ManualFence("kv_transfer", {"kv"}, timeout=10.0, clock=clock)
        req.fences.append(fence)
        machine.finish(req, FinishReason.TRANSFER_FAILED)
        clock.now = 9.0
        assert machine.try_release(req) is False and req.state is S.FINISHED
        if meets_deadline:
            fence.complete()
        else:
            clock.now = 10.5
        assert machine.try_release(req) is True and req.state is S.RELEASED
        report = _check(kv, ledger, idle=True)  # quarantine is not a leak...
        pages = report.pools[KV_PAGES]
        if meets_deadline:
            assert pages.held == pages.quarantined == 0 and machine.quarantined == []
            return
        # the slot is not under the fence (the copy writes pages, not the table): it is back at once
        assert pages.held == pages.quarantined == 3 and report.pools[REQUEST_SLOTS].held == 0
        assert kv.radix.protected_pages == 0 and len(machine.quarantined) == 1
        owners = report.owners[KV_PAGES]  # ...but the report names it
        assert [(o.request_id, o.amount, o.quarantined) for o in owners] == [("req-q", 3, True)]
        assert owners[0].describe() == "req-q (RELEASED, TRANSFER_FAILED) 3 quarantined"
        quarantined = set(machine.quarantined[0].handle.payload.pages)
        fresh = _admit(machine, "b", [7] * 8)
        assert not quarantined & set(_block(fresh).pages)  # never reused
        _release(machine, fresh, FinishReason.ABORT)
        fence.complete()  # the late copy is done at last: the pages come back, uncached
        assert machine.reap_quarantine() == 1 and machine.quarantined == []
        report = _check(kv, ledger, idle=True)
        assert report.pools[KV_PAGES].held == report.pools[KV_PAGES].quarantined == 0
        assert kv.radix.match([1, 2, 3, 4, 5])[0] == []


class KVModel(RuleBasedStateMachine):
    """Random admissions, prefill chunks, decodes, retractions and finishes; fake KV contents."""

    def __init__(self) -> None:
        super().__init__()
        self.kv, self.hook, self.machine, self.ledger = _make_kv(num_pages=12, max_running=3)
        self.live: list[Request] = []
        self.content: dict[int, list] = {}  # page id -> the tokens its KV was computed from
        self.ids = itertools.count()

    def _write(self, req: Request, upto: int) -> None:
        block, tokens = _block(req), req.all_token_ids
        for pos in range(req.kv_len, upto):
            page = self.content.setdefault(block.pages[pos // PS], [None] * PS)
            page[pos % PS] = tokens[pos]
        req.kv_len = upto

    def _in(self, *states):
        return [r for r in self.live if r.state in states]

    @precondition(lambda self: len(self.live) < 6)
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def submit(self, tokens):
        req = Request(f"r{next(self.ids)}", tokens, None)
        self.machine.start(req)
        self.live.append(req)

    @precondition(lambda self: self._in(S.QUEUED))
    @rule(data=st.data())
    def admit(self, data):
        req = data.draw(st.sampled_from(self._in(S.QUEUED)))
        before = _snapshot(self.kv, self.ledger)
        try:
            self.machine.advance(req, S.PREFILLING)
        except ResourceExhausted:
            assert req.state is S.QUEUED and _snapshot(self.kv, self.ledger) == before
            return
        req.kv_len = KVHook.cached_tokens(req)  # as the step applier does on admission
        block, tokens = _block(req), req.all_token_ids
        assert len(block.pages) == self.kv.pages_for(len(tokens)) == len(set(block.pages))
        assert req.kv_len == block.num_prefix_pages * PS < len(tokens)
        for i, page in enumerate(block.pages[: block.num_prefix_pages]):  # cached KV is this prompt's
            assert self.content[page] == tokens[i * PS : (i + 1) * PS]
        row = self.kv.slots.req_to_token[block.slot, : len(tokens)].tolist()
        assert row == [block.pages[i // PS] * PS + i % PS for i in range(len(tokens))]

    @precondition(lambda self: self._in(S.PREFILLING))
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def prefill(self, data, chunk):
        req = data.draw(st.sampled_from(self._in(S.PREFILLING)))
        self._write(req, min(req.kv_len + chunk, req.num_tokens))
        if req.kv_len == req.num_tokens:
            req.output_token_ids.append(data.draw(st.integers(0, 1)))
            self.machine.advance(req, S.PREBUILT)
            self.machine.advance(req, S.DECODING)

    @precondition(lambda self: self._in(S.DECODING))
    @rule(data=st.data())
    def decode(self, data):
        req = data.draw(st.sampled_from(self._in(S.DECODING)))
        if req.num_tokens >= 30:
            return
        before = _snapshot(self.kv, self.ledger)
        if not self.machine.grow(req, req.kv_len + 1):
            assert _snapshot(self.kv, self.ledger) == before
            self.retract_request(req)
            return
        self._write(req, req.kv_len + 1)
        req.output_token_ids.append(data.draw(st.integers(0, 1)))

    def retract_request(self, req: Request) -> None:
        self.machine.advance(req, S.RETRACTED)
        assert "kv" not in req.handles and RequestSlotHook.name not in req.handles
        req.kv_len = 0  # as the loop does: nothing of it is in this engine's pools any more
        self.machine.advance(req, S.QUEUED)

    @precondition(lambda self: self._in(S.DECODING))
    @rule(data=st.data())
    def retract(self, data):
        self.retract_request(data.draw(st.sampled_from(self._in(S.DECODING))))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), reason=st.sampled_from(list(FinishReason)))
    def finish(self, data, reason):
        req = data.draw(st.sampled_from(self.live))
        _release(self.machine, req, reason)
        self.live.remove(req)

    @invariant()
    def pools_add_up(self):
        report = _check(self.kv, self.ledger)
        holders = [r for r in self.live if "kv" in r.handles]
        own = sum(len(_block(r).pages) - _block(r).num_prefix_pages for r in holders)
        assert self.ledger.held(KV_PAGES) == own
        assert report.pools[KV_PAGES].held == own + self.kv.radix.protected_pages
        assert report.pools[REQUEST_SLOTS].held == len(holders)

    def teardown(self):
        for req in list(self.live):
            _release(self.machine, req, FinishReason.SHUTDOWN)
        report = _check(self.kv, self.ledger, idle=True)
        assert report.pools[KV_PAGES].held == 0 and self.kv.radix.protected_pages == 0


TestKVModel = KVModel.TestCase
TestKVModel.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)

"""KV cache events (engine.kv_events): a subscriber's view of the pages equals the prefix cache's,
evictions included; replay fills the batches a subscriber missed; the radix cache's observer seam."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
import zmq

from engine import Engine, InvalidConfig, SamplingParams
from engine.kv_events import KVEventsConfig, KVEventSubscriber, block_hashes, publishing
from engine.kv_events.hashing import cache_hashes
from helpers import DEADLINE, small_config
from resources.radix_cache import RadixCache

PAGE = 4
LOOPBACK = KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
PARAMS = SamplingParams(max_new_tokens=3, ignore_eos=True)


def _prompts(n: int, start: int = 0) -> list[list[int]]:
    """Prompts in families of three sharing a 12-token prefix (so cached pages chain on cached parents)."""
    return [[(7 * (i // 3) + j) % 200 + 1 for j in range(12)] + [(i * 13 + j) % 200 + 1 for j in range(9)]
            for i in range(start, start + n)]


def _radix(engine: Engine) -> RadixCache:
    return engine.parts.kv_pool.radix


@contextlib.asynccontextmanager
async def _followed(**config: Any) -> AsyncIterator[tuple[Engine, Any, KVEventSubscriber]]:
    """An engine publishing its events on loopback, and a subscriber following them."""
    with anyio.fail_after(DEADLINE):
        async with Engine(small_config(page_size=PAGE, **config)) as engine:
            async with publishing(engine, LOOPBACK) as publisher:
                view = KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
                try:
                    yield engine, publisher, view
                finally:
                    view.close()


def _caught_up(view: KVEventSubscriber, publisher, timeout: float = 5.0) -> None:
    assert publisher.wait_published(timeout)
    view.poll(0.2)
    if view.next_seq < publisher.batches:
        view.replay()  # the last batches may still be in flight on a slow machine
    assert view.next_seq == publisher.batches


class TestView:
    @pytest.mark.anyio
    async def test_view_equals_the_cache_after_a_workload_with_eviction(self):
        """Every page the cache holds, and none it evicted, is in the subscriber's view."""
        async with _followed(num_kv_pages=48, max_running=4, max_context=64) as (engine, publisher, view):
            prompts = _prompts(30)
            for prompt in prompts:
                await engine.complete(prompt, PARAMS)
            _caught_up(view, publisher)
            expected = cache_hashes(_radix(engine), PAGE)
            assert view.removed > 0, "the workload was meant to evict"
            assert view.blocks == expected and len(expected) == _radix(engine).total_pages
            last = block_hashes(prompts[-1], PAGE)  # recomputed from the token ids alone
            assert len(last) == 5 and set(last) <= view.blocks
            stored = view.stored_events[-1]
            assert stored.block_size == PAGE and stored.medium == "CPU" and stored.lora_id is None

    @pytest.mark.anyio
    async def test_replay_fills_the_gap_after_a_reconnect(self):
        """Batches sent while a subscriber was away come back by replay; the view ends equal to the cache."""
        async with _followed(num_kv_pages=48, max_running=4, max_context=64) as (engine, publisher, view):
            for prompt in _prompts(6):
                await engine.complete(prompt, PARAMS)
            _caught_up(view, publisher)
            before = view.replayed
            view.disconnect()
            missed = publisher.batches
            for prompt in _prompts(24, start=6):  # published while the view is away
                await engine.complete(prompt, PARAMS)
            assert publisher.wait_published()
            assert publisher.batches > missed + 1
            view.reconnect()
            for prompt in _prompts(20, start=40):  # a live batch shows the gap, replay fills it
                await engine.complete(prompt, PARAMS)
                assert publisher.wait_published()
                view.poll(0.1)
                if view.replayed > before and view.next_seq == publisher.batches:
                    break
            assert view.replayed > before and view.next_seq == publisher.batches
            assert view.blocks == cache_hashes(_radix(engine), PAGE) and view.removed > 0

    @pytest.mark.anyio
    async def test_attach_to_a_warm_cache_then_flush(self):
        """Attaching publishes what is already cached; a flush of an idle engine is AllBlocksCleared."""
        with anyio.fail_after(DEADLINE):
            async with Engine(small_config(page_size=PAGE)) as engine:
                for prompt in _prompts(4):
                    await engine.complete(prompt, PARAMS)
                async with publishing(engine, LOOPBACK) as publisher:
                    view = KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
                    try:
                        _caught_up(view, publisher)
                        assert view.blocks == cache_hashes(_radix(engine), PAGE) and view.blocks
                        cleared = view.cleared
                        freed, kept = engine.flush_prefix_cache()
                        _caught_up(view, publisher)
                        assert freed > 0 and kept == 0 and view.cleared == cleared + 1 and not view.blocks
                    finally:
                        view.close()


class TestSeam:
    def test_observer_sees_stores_evictions_and_clears_in_order(self):
        """The cache reports each new page run with its parent page, each eviction and each clear."""
        seen: list[tuple] = []

        class Recorder:
            def stored(self, parent_page, tokens, pages):
                seen.append(("stored", parent_page, list(tokens), pages.tolist()))

            def removed(self, pages):
                seen.append(("removed", pages.tolist()))

            def cleared(self):
                seen.append(("cleared",))

        cache = RadixCache(2)
        cache.insert([1, 2, 3, 4], [10, 11])  # no observer: nothing recorded
        cache.observer = Recorder()
        cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
        cache.insert([1, 2, 3, 4], [20, 21])  # duplicates: not stored again
        assert cache.evict(1) == [12]
        pages, node = cache.match([1, 2, 3, 4])
        cache.lock(node)
        with pytest.raises(ValueError, match="locked"):
            cache.clear()
        cache.unlock(node)
        assert sorted(cache.clear().tolist()) == [10, 11] and cache.total_pages == 0
        assert seen == [("stored", 11, [5, 6], [12]), ("removed", [12]), ("cleared",)]

    def test_walk_yields_parents_first(self):
        """walk() gives every node after its parent, with the parent's last page."""
        cache = RadixCache(2)
        cache.insert([1, 2, 3, 4], [10, 11])
        cache.insert([1, 2, 5, 6, 7, 8], [10, 12, 13])
        nodes = list(cache.walk())
        assert sum(len(pages) for _, _, pages in nodes) == cache.total_pages == 4
        seen_pages = {None}
        for parent, _, pages in nodes:
            assert parent in seen_pages
            seen_pages.update(np.asarray(pages).tolist())


class TestConfig:
    def test_bad_endpoint_names_the_field(self):
        with pytest.raises(InvalidConfig, match="KVEventsConfig.endpoint"):
            KVEventsConfig(endpoint="http://127.0.0.1:5557")
        with pytest.raises(InvalidConfig, match="KVEventsConfig.buffer_steps"):
            KVEventsConfig(buffer_steps=0)

    def test_defaults_bind_loopback(self):
        config = KVEventsConfig()
        assert config.endpoint.startswith("tcp://127.0.0.1:") and config.replay_endpoint.startswith("tcp://127.0.0.1:")

    @pytest.mark.anyio
    async def test_an_endpoint_in_use_fails_before_serving(self):
        """A port already bound is an OSError naming the endpoint, raised by entering `publishing`."""
        context = zmq.Context()
        taken = context.socket(zmq.PUB)
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        try:
            async with Engine(small_config()) as engine:
                with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                    async with publishing(engine, KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}",
                                                                 replay_endpoint=None)):
                        pass
        finally:
            taken.close(0)
            context.term()


class TestPublisher:
    def test_a_run_under_an_unknown_parent_is_skipped_and_the_rest_published(self):
        """An inconsistent event (a parent page it never saw) is counted and skipped, never hashed wrong;
        the events around it are still published."""
        from engine.kv_events.publisher import KVEventPublisher

        publisher = KVEventPublisher(LOOPBACK, page_size=2, medium="CPU")
        publisher.start()
        view = KVEventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
        try:
            publisher.stored(None, [1, 2], np.array([10]))
            publisher.stored(99, [3, 4], np.array([11]))  # page 99 was never stored
            publisher.stored(10, [3, 4], np.array([12]))
            _caught_up(view, publisher)
        finally:
            view.close()
            publisher.close()
        assert publisher.errors == 1
        assert view.blocks == set(block_hashes([1, 2, 3, 4], 2)) and len(view.blocks) == 2

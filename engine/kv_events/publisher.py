"""The publisher: an observer of the prefix cache and one thread that hashes, encodes and sends.

    async with publishing(engine, KVEventsConfig()) as publisher:   # attach, serve, detach
        ...

The radix cache calls `stored`, `removed` and `cleared` on the engine loop's thread, in the order
the cache changes (resources.radix_cache.CacheObserver); each only puts a tuple on a queue. The
publishing thread owns both sockets and everything else: it keeps page id -> digest for the pages
in the cache (so a page's hash chains from its parent page's), turns each change into a vLLM event
(engine.kv_events.wire), sends whatever is queued as one `EventBatch` with the next sequence
number (0, 1, 2, ...), keeps the last `buffer_steps` batches, and answers replay requests between
batches. With no publisher attached the cache computes nothing for it.

Attaching publishes `AllBlocksCleared` first (a subscriber that followed an earlier process at
the same endpoint starts over), then a `BlockStored` for every page already cached; detaching
publishes `AllBlocksCleared` (the cache goes away with the process). A ZeroMQ error binding or
connecting is raised by `start()` (OSError naming the endpoint), before the engine serves.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import structlog
import zmq

from engine.kv_events.hashing import external, page_digest
from engine.kv_events.settings import KVEventsConfig
from engine.kv_events.wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, seq_bytes
from engine.thread_names import named_thread

log = structlog.get_logger("kvlife.kv_events")
_STORED, _REMOVED, _CLEARED, _MARK, _STOP = range(5)
_MAX_BATCH_ITEMS = 4096


def _bindable(endpoint: str) -> str:
    """tcp://host:0 as ZeroMQ spells "any free port"."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, *, page_size: int, medium: str) -> None:
        self.config = config
        self.page_size = page_size
        self.medium = config.medium or medium
        self.endpoint = config.endpoint  # the bound addresses once started (a port 0 resolved)
        self.replay_endpoint = config.replay_endpoint
        self.batches = 0
        self.replays = 0
        self.errors = 0  # batches that failed to build or send (logged as kv_events.batch_failed)
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # ------------------------------------------ CacheObserver (the engine loop's thread)
    def stored(self, parent_page: int | None, tokens: list[int], pages: np.ndarray) -> None:
        self._queue.put((_STORED, parent_page, tokens, pages))

    def removed(self, pages: np.ndarray) -> None:
        self._queue.put((_REMOVED, pages))

    def cleared(self) -> None:
        self._queue.put((_CLEARED,))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Open the sockets on the publishing thread; OSError if one cannot bind or connect."""
        self._thread = named_thread(self._run, name="kvlife-kv-events")
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            self._thread.join(5)
            raise OSError(f"KV events: cannot open {self.config.endpoint} / {self.config.replay_endpoint}: "
                          f"{self._error}")
        log.info("kv_events.started", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                 connect=self.config.connect, topic=self.config.topic)

    def attach(self, radix: Any) -> None:
        """Follow `radix` from now on: AllBlocksCleared, then every page it holds, then its changes."""
        self.cleared()
        for parent_page, tokens, pages in radix.walk():
            self.stored(parent_page, tokens, pages)
        radix.observer = self

    def detach(self, radix: Any) -> None:
        if radix.observer is self:
            radix.observer = None
            self.cleared()

    def wait_published(self, timeout: float = 10.0) -> bool:
        """Block until everything queued so far is sent (tests, shutdown); False on timeout."""
        done = threading.Event()
        self._queue.put((_MARK, done))
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._queue.put((_STOP,))
        self._thread.join(timeout)
        self._thread = None
        log.info("kv_events.stopped", batches=self.batches, replays=self.replays)

    # ------------------------------------------------------------ the publishing thread
    def _run(self) -> None:
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        replay = context.socket(zmq.ROUTER) if self.config.replay_endpoint is not None else None
        try:
            pub.set_hwm(self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            if self.config.connect:
                pub.connect(self.config.endpoint)
            else:
                pub.bind(_bindable(self.config.endpoint))
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay is not None:
                assert self.config.replay_endpoint is not None
                replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(_bindable(self.config.replay_endpoint))
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
        self._ready.set()
        try:
            if self._error is None:
                self._serve(pub, replay)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close()
            context.term()

    def _serve(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        history: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        digests: dict[int, tuple[bytes, int]] = {}  # page id -> (digest, event hash), pages now cached
        seq = 0
        while True:
            while replay is not None and replay.poll(0):
                self._answer_replay(replay, topic, history)
            try:
                items = [self._queue.get(timeout=0.02)]
            except queue.Empty:
                continue
            while len(items) < _MAX_BATCH_ITEMS:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                events, marks, stop = self._events(items, digests)
                if events:
                    payload = encoder.encode(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
                    pub.send_multipart([topic, seq_bytes(seq), payload])
                    history.append((seq, payload))
                    seq += 1
                    self.batches = seq
            except Exception as exc:  # noqa: BLE001 - the thread must outlive a bad batch: logged, counted
                self.errors += 1
                log.error("kv_events.batch_failed", error=repr(exc), items=len(items))
                marks, stop = [item[1] for item in items if item[0] == _MARK], any(i[0] == _STOP for i in items)
            for mark in marks:
                mark.set()
            if stop:
                return

    def _events(self, items: list[tuple[Any, ...]],
                digests: dict[int, tuple[bytes, int]]) -> tuple[list[Any], list[threading.Event], bool]:
        events: list[Any] = []
        marks: list[threading.Event] = []
        ps, seed = self.page_size, self.config.hash_seed
        for item in items:
            kind = item[0]
            if kind == _STORED:
                _, parent_page, tokens, pages = item
                parent = None if parent_page is None else digests.get(int(parent_page))
                if parent_page is not None and parent is None:  # NOTE: cannot happen while attached from the start
                    self.errors += 1
                    log.error("kv_events.unknown_parent", parent_page=int(parent_page), pages=len(pages))
                    continue
                digest = None if parent is None else parent[0]
                hashes = []
                for j, page in enumerate(pages.tolist()):
                    digest = page_digest(digest, tokens[j * ps : (j + 1) * ps], seed)
                    digests[page] = (digest, external(digest))
                    hashes.append(digests[page][1])
                events.append(BlockStored(block_hashes=hashes, parent_block_hash=None if parent is None else parent[1],
                                          token_ids=list(tokens[: len(hashes) * ps]), block_size=ps, lora_id=None,
                                          medium=self.medium, lora_name=None, group_idx=0,
                                          kv_cache_spec_kind="full_attention"))
            elif kind == _REMOVED:
                gone = [digests.pop(page)[1] for page in item[1].tolist() if page in digests]
                if gone:
                    events.append(BlockRemoved(block_hashes=gone, medium=self.medium, group_idx=0))
            elif kind == _CLEARED:
                digests.clear()
                events.append(AllBlocksCleared())
            elif kind == _MARK:
                marks.append(item[1])
            else:
                return events, marks, True
        return events, marks, False

    def _answer_replay(self, replay: zmq.Socket, topic: bytes, history: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events.bad_replay_request", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in history:
            if seq >= first:
                replay.send_multipart([client, b"", topic, seq_bytes(seq), payload])
        replay.send_multipart([client, b"", b"", END_SEQ, b""])
        self.replays += 1


@contextlib.asynccontextmanager
async def publishing(engine: Any, config: KVEventsConfig) -> AsyncIterator[KVEventPublisher]:
    """Publish `engine`'s prefix-cache events while the block runs (enter it inside `async with engine`,
    or around it: attaching only needs the engine built)."""
    radix = engine.parts.kv_pool.radix
    medium = "GPU" if str(engine.config.device).startswith("cuda") else "CPU"
    publisher = KVEventPublisher(config, page_size=engine.config.page_size, medium=medium)
    publisher.start()
    try:
        publisher.attach(radix)
        yield publisher
    finally:
        publisher.detach(radix)
        publisher.close()

"""A reference subscriber: follows one publisher's batches, replays what it missed, and keeps the
set of page hashes the publisher's cache holds.

    view = KVEventSubscriber("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    view.poll(timeout=1.0)          # apply what arrived; a gap in sequence numbers is replayed first
    view.blocks                     # the hashes of every cached page
    view.close()

Sequence numbers run 0, 1, 2, ... per publisher. When a batch's number is not the next one (the
subscriber joined late, reconnected, or the PUB socket dropped messages at its high-water mark),
the subscriber asks the replay socket for every buffered batch from the first one it is missing
(a DEALER sends ``[b"", seq]``; answers are ``[b"", topic, seq, payload]`` and a ``-1`` end
marker), applies those in order, then carries on. `replayed` counts batches that came by replay.
A subscriber written in another language does the same with vLLM's structs (engine.kv_events.wire).
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from engine.kv_events.wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, seq_bytes


class KVEventSubscriber:
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 bind: bool = False) -> None:
        self._context = zmq.Context()
        self.endpoint, self.topic, self.bind = endpoint, topic, bind
        self._sub: zmq.Socket | None = self._open()
        self.replay_endpoint = replay_endpoint
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.blocks: set[int] = set()
        self.next_seq = 0
        self.batches = 0
        self.replayed = 0
        self.removed = 0  # page hashes removed (evictions)
        self.cleared = 0  # AllBlocksCleared events
        self.stored_events: list[BlockStored] = []

    def _open(self) -> zmq.Socket:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.setsockopt(zmq.LINGER, 0)
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        return sub

    def disconnect(self) -> None:
        """Drop the connection, keeping the view and the next sequence number (a consumer going away)."""
        if self._sub is not None:
            self._sub.close()
            self._sub = None

    def reconnect(self) -> None:
        """Connect again; batches sent while away come back by replay at the first gap `poll` sees."""
        self.disconnect()
        self._sub = self._open()

    # ------------------------------------------------------------------ receiving
    def poll(self, timeout: float = 0.5) -> int:
        """Apply every batch that arrives within `timeout` (seconds, until a quiet spell); how many."""
        if self._sub is None:
            raise RuntimeError("disconnected: call reconnect() first")
        applied = 0
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            _topic, seq, payload = self._sub.recv_multipart()
            applied += self._receive(int.from_bytes(seq, "big"), payload)
            wait_ms = 50
        return applied

    def _receive(self, seq: int, payload: bytes) -> int:
        if seq < self.next_seq:
            return 0  # already applied (it came by replay)
        applied = 0
        if seq > self.next_seq:
            applied += self.replay()
            if seq < self.next_seq:
                return applied
        self._apply(payload)
        self.next_seq = seq + 1
        return applied + 1

    def replay(self, timeout: float = 5.0) -> int:
        """Ask the replay socket for every batch from `next_seq` and apply them; how many came."""
        if self.replay_endpoint is None:
            raise RuntimeError("a gap in the event sequence, and no replay endpoint to fill it")
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        applied = 0
        try:
            dealer.send_multipart([b"", seq_bytes(self.next_seq)])
            while True:
                if not dealer.poll(int(timeout * 1000)):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint} within {timeout}s")
                _, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return applied
                number = int.from_bytes(seq, "big")
                if number >= self.next_seq:
                    self._apply(payload)
                    self.next_seq = number + 1
                    self.replayed += 1
                    applied += 1
        finally:
            dealer.close()

    def _apply(self, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        self.batches += 1
        for event in batch.events:
            self.apply_event(event)

    def apply_event(self, event: Any) -> None:
        if isinstance(event, BlockStored):
            self.blocks.update(event.block_hashes)
            self.stored_events.append(event)
        elif isinstance(event, BlockRemoved):
            self.blocks.difference_update(event.block_hashes)
            self.removed += len(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()
            self.cleared += 1

    def close(self) -> None:
        self.disconnect()
        self._context.term()

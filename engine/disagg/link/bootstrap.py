"""Bootstrap: how a decode and a prefill become a link.

The prefill hosts a TCPStore on its bootstrap port. Keys (all under
``kvlife/``)::

    boot                  prefill: {"protocol", "boot" (this process), "challenge"}
    pairs                 a counter; a decode takes a pair id with add(1)
    pair/<id>/hello       decode: {"nonce", "proof" = HMAC(secret, hello|challenge|id|nonce)}
    pair/<id>/verdict     prefill: {"ok", "reason"} or {"ok", "proof", "record", "boot"}
    pair/<id>/accept      decode: {"ok", "reason", "record"}
    pair/<id>/<token>/    the pair's process groups (token derived from the secret)

The hello is the first thing a decode writes: the prefill reads nothing
else of a pair whose proof is wrong, answers "authentication failed" and
counts it. The verdict carries the prefill's own proof, so the decode
never lets a process that lacks the secret write into its pages. Then
each side compares the other's compatibility record field by field, and
only if they agree do both build the pair's groups. Without a secret,
proofs are empty and both sides only bind or dial loopback addresses
(`engine.disagg.link.settings`).
"""

from __future__ import annotations

import datetime
import json
import secrets
import socket
import time
from typing import Any

import attrs
import torch.distributed as dist

from engine.disagg.link.settings import LinkSettings
from engine.disagg.link.transport import LinkError
from engine.disagg.link.wire import PROTOCOL_VERSION, proof, proof_ok, record_mismatch

ROOT = "kvlife/"


class PeerRefused(LinkError):
    """The peer refused this side, or this side refused the peer (`cause`: auth, incompatible, protocol)."""


@attrs.frozen
class Handshake:
    """A pair both sides agreed to build."""

    pair_id: int
    prefix: str
    boot: str
    store: Any
    peer_record: dict


def _json(store: Any, key: str) -> Any:
    try:
        return json.loads(store.get(key))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PeerRefused("protocol", f"unreadable bootstrap key {key!r}") from exc


def _group_prefix(secret: str | None, challenge: str, pair_id: int, nonce: str) -> str:
    token = proof(secret, "group", challenge, pair_id, nonce)[:32] or nonce
    return f"{ROOT}pair/{pair_id}/{token}/"


# ----------------------------------------------------------------- decode side
def connect(host: str, port: int, settings: LinkSettings, record: dict) -> Handshake:
    """Dial a prefill's bootstrap store and agree on a pair; raises LinkError / PeerRefused."""
    timeout = settings.connect_timeout
    try:  # fail fast on a closed port instead of the store's retry loop
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise LinkError("peer_closed", f"cannot reach {host}:{port}: {exc}") from exc
    try:
        store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
        boot = _json(store, ROOT + "boot")
        if boot.get("protocol") != PROTOCOL_VERSION:
            raise PeerRefused("incompatible", f"protocol {PROTOCOL_VERSION} here, {boot.get('protocol')!r} there")
        pair_id = store.add(ROOT + "pairs", 1)
        nonce = secrets.token_hex(16)
        base = f"{ROOT}pair/{pair_id}/"
        store.set(base + "hello", json.dumps({"nonce": nonce, "proof": proof(settings.secret, "hello",
                                                                             boot["challenge"], pair_id, nonce)}))
        store.wait([base + "verdict"], datetime.timedelta(seconds=timeout))
        verdict = _json(store, base + "verdict")
    except LinkError:
        raise
    except Exception as exc:  # noqa: BLE001 - DistStoreError, timeouts, resets
        raise LinkError("peer_closed" if "onnect" in str(exc) else "timeout", f"bootstrap with {host}:{port}: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}") from exc
    if not verdict.get("ok"):
        raise PeerRefused("auth" if "authentic" in str(verdict.get("reason")) else "incompatible",
                          f"prefill {host}:{port} refused this decode: {verdict.get('reason')}")
    if not proof_ok(settings.secret, verdict.get("proof"), "verdict", boot["challenge"], pair_id, nonce):
        store.set(base + "accept", json.dumps({"ok": False, "reason": "authentication failed"}))
        raise PeerRefused("auth", f"prefill {host}:{port} did not prove it holds the shared secret")
    mismatch = record_mismatch(record, verdict.get("record"))
    if mismatch is not None:
        store.set(base + "accept", json.dumps({"ok": False, "reason": f"incompatible: {mismatch}", "record": record}))
        raise PeerRefused("incompatible", f"prefill {host}:{port} is incompatible: {mismatch}")
    store.set(base + "accept", json.dumps({"ok": True, "record": record}))
    return Handshake(pair_id, _group_prefix(settings.secret, boot["challenge"], pair_id, nonce),
                     str(verdict.get("boot")), store, verdict["record"])


# ---------------------------------------------------------------- prefill side
class BootstrapServer:
    """The prefill's bootstrap store and the state of every pair being agreed.

    `poll()` (one thread, every few ms) advances each pair and returns the
    handshakes that completed; refusals are counted in `refused[cause]`.
    """

    def __init__(self, settings: LinkSettings, port: int, record: dict, log: Any,
                 on_refused: Any = None) -> None:
        self.settings = settings
        self.record = record
        self.log = log
        self.on_refused = on_refused
        timeout = datetime.timedelta(seconds=settings.connect_timeout)
        self.store = dist.TCPStore(settings.host, port, None, True, timeout, wait_for_workers=False)
        self.port = self.store.port
        self.boot = secrets.token_hex(8)
        self.challenge = secrets.token_hex(16)
        self.store.set(ROOT + "boot", json.dumps({"protocol": PROTOCOL_VERSION, "boot": self.boot,
                                                  "challenge": self.challenge}))
        self.refused: dict[str, int] = {}
        self._next = 1
        self._pending: dict[int, dict[str, Any]] = {}  # pair id -> {"since", "nonce"?}

    @property
    def handshaking(self) -> bool:
        """Whether a pair is being agreed (its next steps are due soon)."""
        return bool(self._pending)

    def poll(self) -> list[Handshake]:
        now = time.monotonic()
        taken = self.store.add(ROOT + "pairs", 0)
        while self._next <= taken:
            self._pending[self._next] = {"since": now}
            self._next += 1
        done = []
        for pair_id, state in list(self._pending.items()):
            base = f"{ROOT}pair/{pair_id}/"
            if "nonce" not in state and self.store.check([base + "hello"]):
                if not self._answer(pair_id, state, base):
                    del self._pending[pair_id]
            elif "nonce" in state and self.store.check([base + "accept"]):
                del self._pending[pair_id]
                handshake = self._accepted(pair_id, state, base)
                if handshake is not None:
                    done.append(handshake)
            elif now - state["since"] > self.settings.connect_timeout:
                del self._pending[pair_id]  # a decode that took an id and went away
        return done

    def _refuse(self, cause: str, pair_id: int, reason: str) -> None:
        self.refused[cause] = self.refused.get(cause, 0) + 1
        if self.on_refused is not None:
            self.on_refused(cause)
        self.log.warning("transfer.refused", pair=pair_id, cause=cause, reason=reason)

    def _answer(self, pair_id: int, state: dict, base: str) -> bool:
        try:
            hello = json.loads(self.store.get(base + "hello"))
            nonce = str(hello["nonce"])
            presented = hello.get("proof")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            nonce, presented = "", None
        if not nonce or not proof_ok(self.settings.secret, presented, "hello", self.challenge, pair_id, nonce):
            self.store.set(base + "verdict", json.dumps({"ok": False, "reason": "authentication failed"}))
            self._refuse("auth", pair_id, "a decode did not prove it holds the shared secret")
            return False
        state["nonce"] = nonce
        state["since"] = time.monotonic()
        self.store.set(base + "verdict", json.dumps({
            "ok": True, "boot": self.boot, "record": self.record,
            "proof": proof(self.settings.secret, "verdict", self.challenge, pair_id, nonce)}))
        return True

    def _accepted(self, pair_id: int, state: dict, base: str) -> Handshake | None:
        try:
            accept = json.loads(self.store.get(base + "accept"))
        except (ValueError, UnicodeDecodeError):
            accept = {"ok": False, "reason": "unreadable accept"}
        if not accept.get("ok"):
            reason = str(accept.get("reason"))
            self._refuse("auth" if "authentic" in reason else "incompatible", pair_id, reason)
            return None
        mismatch = record_mismatch(self.record, accept.get("record"))
        if mismatch is not None:
            self._refuse("incompatible", pair_id, mismatch)
            return None
        prefix = _group_prefix(self.settings.secret, self.challenge, pair_id, state["nonce"])
        return Handshake(pair_id, prefix, self.boot, self.store, accept["record"])

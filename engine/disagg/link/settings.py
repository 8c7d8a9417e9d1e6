"""Settings of the two multi-process roles: `RemotePrefill` (the decode side)
and `PrefillServerConfig` (the prefill side), on a shared `LinkSettings`.

    EngineConfig(disaggregation="decode",
                 remote_prefill=RemotePrefill(peers=("10.0.0.5:31001",), secret="..."))
    PrefillServer(EngineConfig(...), PrefillServerConfig(bootstrap_port=31001, secret="..."))

Every wait on a link has a bound, from these fields:

    liveness        each side sends a keepalive every `keepalive` s when it has
                    nothing else to send; a side that hears nothing for
                    `liveness_timeout` (4 keepalives) ends the link
    first answer    a job's header must arrive within `first_timeout` of its
                    submission (the prefill's compute budget, queueing included);
                    a late one fails that job alone (the link stays up)
    each chunk      chunk bytes / `floor_bandwidth` + `chunk_slack`

A dead or stopped peer is therefore noticed within `dead_peer_bound`, the
larger of `liveness_timeout` and the largest chunk's bound (4 s with the
defaults), whatever `first_timeout` is: its link goes down, its jobs move
to another live peer or fail, and while no peer is up the decode admits
nothing into TRANSFERRING. On the prefill side a dead decode's jobs are
cancelled and released within the same bound.

`fence_bound` adds them up for a request of N tokens; the decode checks at
construction that `EngineConfig.fence_timeout` covers it for `max_context`,
so a transport failure always ends as TRANSFER_FAILED with the pages freed
and a quarantine only means a receiving thread itself wedged.

Trust: with a shared `secret` (or the KVLIFE_DISAGG_SECRET environment
variable) a peer must prove it holds the secret before anything else is
exchanged. Without one, both roles only bind and dial loopback addresses.
The secret is never part of a repr or a log line.
"""

from __future__ import annotations

import ipaddress
import math
import os
from typing import Any

import attrs

from engine.errors import InvalidConfig

SECRET_ENV = "KVLIFE_DISAGG_SECRET"
BACKENDS = ("gloo", "nccl")
#: `LinkSettings.transport`'s values
TRANSPORTS = ("auto", "gloo")
#: the default `LinkSettings.direct_min_run_bytes`
DIRECT_MIN_RUN_BYTES = 64 << 10


def _env_secret() -> str | None:
    return os.environ.get(SECRET_ENV) or None


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or 'localhost'."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_address(text: Any, field: str) -> tuple[str, int]:
    """'host:port' (IPv6 as '[::1]:port') -> (host, port); InvalidConfig naming `field` otherwise."""
    limit = "'host:port' with a port in [1, 65535]"
    if not isinstance(text, str) or ":" not in text:
        raise InvalidConfig(field, limit, text)
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidConfig(field, limit, text)
    return host, int(port)


def _positive(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise InvalidConfig(f"{type(inst).__name__}.{attribute.name}", "a finite number > 0", value)


def _int_at_least(low: int):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            raise InvalidConfig(f"{type(inst).__name__}.{attribute.name}", f"an integer >= {low}", value)

    return check


@attrs.frozen
class LinkSettings:
    """What both roles agree on for a prefill/decode link (see the module docstring)."""

    #: the address this side binds: the bootstrap store (prefill) and the pair's sockets (both)
    host: str = attrs.field(default="127.0.0.1")
    #: shared secret; None reads KVLIFE_DISAGG_SECRET; unset means loopback peers only
    secret: str | None = attrs.field(factory=_env_secret, repr=False)
    #: "gloo" (CPU tensors, host staging on CUDA) or "nccl" (device tensors; 2+ GPUs)
    backend: str = attrs.field(default="gloo")
    first_timeout: float = attrs.field(default=20.0, validator=_positive)
    floor_bandwidth: float = attrs.field(default=100e6, validator=_positive)  # bytes/s
    chunk_slack: float = attrs.field(default=0.5, validator=_positive)
    max_chunk_bytes: int = attrs.field(default=16 << 20, validator=_int_at_least(1 << 10))
    keepalive: float = attrs.field(default=1.0, validator=_positive)
    connect_timeout: float = attrs.field(default=10.0, validator=_positive)
    #: bytes of staging a side may hold at once (the fallback: see `direct_min_run_bytes`)
    staging_bytes: int = attrs.field(default=256 << 20, validator=_int_at_least(1 << 10))
    #: a side sends from / receives into its KV buffers directly (one message per layer, K or V and run of
    #: page locations) when its runs average at least this many bytes of one layer's K; shorter runs, and
    #: KV the data group cannot reach (CUDA KV over gloo), go through staging (one gather or scatter)
    direct_min_run_bytes: int = attrs.field(default=DIRECT_MIN_RUN_BYTES, validator=_int_at_least(0))
    #: what carries a link with backend "gloo": "auto" (kvlife's sockets, a control and a data connection
    #: driven by native threads, `engine.disagg.link.socket_transport`, where both sides can build them; else
    #: gloo) or "gloo"
    transport: str = attrs.field(default="auto")

    def __attrs_post_init__(self) -> None:
        p = type(self).__name__
        if not isinstance(self.host, str) or not self.host:
            raise InvalidConfig(f"{p}.host", "an address such as '127.0.0.1'", self.host)
        if self.secret is not None and (not isinstance(self.secret, str) or len(self.secret) < 8):
            raise InvalidConfig(f"{p}.secret", "None or a string of at least 8 characters", "<hidden>")
        if self.backend not in BACKENDS:
            raise InvalidConfig(f"{p}.backend", f"one of {BACKENDS}", self.backend)
        if self.transport not in TRANSPORTS:
            raise InvalidConfig(f"{p}.transport", f"one of {TRANSPORTS}", self.transport)
        if self.secret is None and not is_loopback(self.host):
            raise InvalidConfig(f"{p}.host", f"a loopback address unless a secret is set ({p}.secret or "
                                f"{SECRET_ENV})", self.host)
        if self.staging_bytes < 2 * self.max_chunk_bytes:
            raise InvalidConfig(f"{p}.staging_bytes", f">= 2 * max_chunk_bytes = {2 * self.max_chunk_bytes}",
                                self.staging_bytes)

    @property
    def liveness_timeout(self) -> float:
        """Silence after which a side ends the link."""
        return 4 * self.keepalive

    @property
    def dead_peer_bound(self) -> float:
        """Longest a dead or stopped peer goes unnoticed: no keepalive for `liveness_timeout`, or, in the
        middle of a chunk, that chunk's timeout (with `max_chunk_bytes`)."""
        return max(self.liveness_timeout, self.chunk_timeout(self.max_chunk_bytes))

    def chunk_timeout(self, nbytes: int) -> float:
        return nbytes / self.floor_bandwidth + self.chunk_slack

    def fence_bound(self, chunk_sizes: list[int]) -> float:
        """Longest a job of these chunks can keep its fence open when every wait hits its bound."""
        return self.first_timeout + sum(self.chunk_timeout(n) for n in chunk_sizes) + self.chunk_slack


@attrs.frozen
class RemotePrefill(LinkSettings):
    """The decode role's prefill servers (EngineConfig.remote_prefill)."""

    #: prefill servers' bootstrap addresses, 'host:port'
    peers: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(v) if isinstance(v, (list, tuple)) else v)
    reconnect_interval: float = attrs.field(default=1.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not isinstance(self.peers, tuple) or not self.peers:
            raise InvalidConfig("RemotePrefill.peers", "a non-empty list of 'host:port'", self.peers)
        seen = set()
        for peer in self.peers:
            host, port = parse_address(peer, "RemotePrefill.peers")
            if self.secret is None and not is_loopback(host):
                raise InvalidConfig("RemotePrefill.peers", f"loopback addresses unless a secret is set "
                                    f"(RemotePrefill.secret or {SECRET_ENV})", peer)
            if (host, port) in seen:
                raise InvalidConfig("RemotePrefill.peers", "distinct addresses", peer)
            seen.add((host, port))

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [parse_address(p, "RemotePrefill.peers") for p in self.peers]

    def validate_against(self, engine_config: Any) -> None:
        """What can be checked before the model is loaded (the full fence check runs at assembly)."""
        if engine_config.disaggregation != "decode":
            raise InvalidConfig("EngineConfig.remote_prefill", "None unless disaggregation='decode'",
                                engine_config.disaggregation)
        least = self.fence_bound([0])
        if engine_config.fence_timeout < least:
            raise InvalidConfig("EngineConfig.fence_timeout", f">= {least:g} s (RemotePrefill.first_timeout + one "
                                "chunk's slack + margin)", engine_config.fence_timeout)


@attrs.frozen
class PrefillServerConfig(LinkSettings):
    """A prefill server's bootstrap address and limits."""

    #: the bootstrap store's port; 0 picks a free one (PrefillServer.bootstrap_port says which)
    bootstrap_port: int = attrs.field(default=0, validator=_int_at_least(0))
    #: decode links served at once
    max_links: int = attrs.field(default=16, validator=_int_at_least(1))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.bootstrap_port > 65535:
            raise InvalidConfig("PrefillServerConfig.bootstrap_port", "an integer in [0, 65535]", self.bootstrap_port)

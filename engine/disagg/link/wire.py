"""The link's wire format: fixed headers, job frames, chunk plans, the
compatibility record and the handshake's proofs.

Every message is a tensor; a header is `int64[8]`. Per link, in FIFO order::

    decode -> prefill (tag CTL)   header [op, tag, a, b, 0, 0, 0, 0]
        JOB     tag, a = payload bytes       then uint8[a]: the job frame
        CANCEL  tag                          the decode gave the job up
        PING                                 keepalive
        BYE                                  the decode is leaving

    prefill -> decode (tag DATA)  header [op, tag, status, first_token, reason_bytes, logprob_bytes,
                                          runs, direct]
        RESULT  for the oldest job not yet answered; then uint8[reason_bytes]
                if any; then uint8[logprob_bytes] if any (the first token's
                logprob, when the job asked for logprobs: `encode_logprob`);
                then int64[runs] if any: where the prefill's runs of KV
                locations start (`direct` 1: it sends from its KV buffers;
                0: from staging); if status is OK, the messages of every
                chunk of `chunk_plan` (`engine.disagg.link.messages`)
        PING                                 keepalive
        BYE                                  the prefill is leaving

A job frame is ``int64[n] token ids | uint8 images | utf-8 JSON meta`` with
the meta's length in its last 8 bytes (request id, sampling parameters, the
tokens generated before a retraction, image shapes, the compute budget, the
chunk size both sides plan with, and where the decode's runs of page
locations start, or null when it receives into staging).

A chunk is a run of whole layers for all tokens, or, when one layer does not
fit in `max_chunk_bytes`, a run of tokens of one layer, laid out as
``[layers, 2 (K, V), tokens, kv_heads, head_dim]`` in the KV dtype; it
travels as one message, or as one per layer, K or V and run of locations
when either side sends from or receives into its KV buffers directly.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

from states import TokenLogprob

#: 2: the RESULT frame carries the first token's logprob; 3: chunks travel as messages per layer, K/V and
#: page run, sent from and received into the KV buffers (the run starts in JOB and RESULT); 4: a RESULT's
#: run starts ride in its header when they fit (`INLINE_RUNS`): no round trip for a message of their own,
#: gloo chunks travel in a group (a socket) of their own, apart from the control messages, and one JOB
#: message carries up to `MAX_JOBS` jobs (a round trip per batch of jobs, not per job)
PROTOCOL_VERSION = 4
HEADER_LEN = 32
#: run starts a RESULT header carries itself (after its 8 fields); more travel in a message after it
INLINE_RUNS = HEADER_LEN - 8
#: jobs one JOB message carries at most (each one's tag and frame size ride in its header), and the bytes
#: of job frames the decode batches into one (a bigger frame travels alone)
MAX_JOBS, JOB_BATCH_BYTES = (HEADER_LEN - 4) // 2, 1 << 20
CTL, DATA = 0, 1  # tags: decode -> prefill, prefill -> decode

JOB, CANCEL, PING, BYE, RESULT = 1, 2, 3, 4, 5
OK, FAILED, CANCELLED = 0, 1, 2
STATUS_NAMES = {OK: "ok", FAILED: "failed", CANCELLED: "cancelled"}


class ProtocolError(RuntimeError):
    """A peer sent something the protocol does not allow."""


def header(op: int, tag: int = 0, *fields: int) -> torch.Tensor:
    values = [op, tag, *fields]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)


def jobs_header(frames: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The header of a JOB message carrying these (tag, frame) jobs, their frames concatenated after it."""
    if not 1 <= len(frames) <= MAX_JOBS:
        raise ValueError(f"1 to {MAX_JOBS} jobs per JOB message, not {len(frames)}")
    index = [x for tag, frame in frames for x in (tag, frame.numel())]
    return header(JOB, 0, sum(frame.numel() for _, frame in frames), len(frames), *index)


def job_index(values: list[int], max_bytes: int) -> list[tuple[int, int]]:
    """(tag, frame size) of each job a JOB header's values announce, in order; ProtocolError if they are
    malformed or their frames exceed `max_bytes` together."""
    size, count = values[2], values[3]
    if not 1 <= count <= MAX_JOBS:
        raise ProtocolError(f"a JOB message announces {count} jobs (1 to {MAX_JOBS})")
    index = [(values[4 + 2 * i], values[5 + 2 * i]) for i in range(count)]
    if any(n <= 0 for _, n in index) or sum(n for _, n in index) != size or not 0 < size <= max_bytes:
        raise ProtocolError(f"a JOB message's frame sizes {[n for _, n in index]} do not make its {size} bytes "
                            f"(at most {max_bytes})")
    return index


def result_frames(tag: int, status: int, first_token: int, reason: bytes, logprob: bytes,
                  runs: list[int] | None) -> list[torch.Tensor]:
    """A RESULT's messages, in order: its header (with the run starts when they fit), the reason and
    the logprob if any, the run starts if they did not fit (`INLINE_RUNS`)."""
    inline = runs if runs is not None and len(runs) <= INLINE_RUNS else []
    frames = [header(RESULT, tag, status, first_token, len(reason), len(logprob), len(runs or ()),
                     int(runs is not None), *inline)]
    frames += [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (reason, logprob) if b]
    if runs and not inline:
        frames.append(torch.tensor(runs, dtype=torch.int64))
    return frames


def inline_runs(values: list[int]) -> list[int] | None:
    """The run starts a RESULT header's values carry, None if they travel in a message of their own."""
    runs_len = values[6]
    return values[8: 8 + runs_len] if runs_len <= INLINE_RUNS else None


# ---------------------------------------------------------------- job frames
@attrs.frozen
class JobSpec:
    """What a prefill needs to run one job (the decode's TransferJob, minus its memory)."""

    request_id: str
    token_ids: list[int]
    params: dict[str, Any]
    output_token_ids: list[int] = attrs.field(factory=list)
    images: list[torch.Tensor] = attrs.field(factory=list)
    budget: float = 0.0
    max_chunk_bytes: int = 16 << 20
    #: where the decode's runs of page locations start (it receives into its pages); None: into staging
    runs: list[int] | None = None


def encode_job(spec: JobSpec) -> torch.Tensor:
    images = [img.contiguous().to(torch.uint8).cpu() for img in spec.images]
    meta = json.dumps({
        "request_id": spec.request_id, "params": spec.params, "output_token_ids": spec.output_token_ids,
        "images": [list(img.shape) for img in images], "budget": spec.budget,
        "max_chunk_bytes": spec.max_chunk_bytes, "runs": spec.runs,
    }).encode()
    # NOTE: the token ids through `array` (native int64, as torch's): 4x faster than torch.tensor of a list
    parts = [torch.frombuffer(bytearray(_int64s(spec.token_ids)), dtype=torch.uint8)]
    parts += [img.reshape(-1) for img in images]
    parts += [torch.frombuffer(bytearray(meta), dtype=torch.uint8),
              torch.tensor([len(meta)], dtype=torch.int64).view(torch.uint8)]
    return torch.cat(parts)


def _int64s(values: list[int]) -> bytes:
    """Native int64s (what torch's int64 tensors hold); OverflowError names a value out of range."""
    return array.array("q", values).tobytes()


def decode_job(frame: torch.Tensor, *, vocab_size: int | None = None) -> JobSpec:
    """A job frame's spec; ProtocolError if it is malformed, or (given `vocab_size`) if a token id is
    outside [0, vocab_size): checked in numpy on the link's thread, not over a list on the event loop."""
    raw = frame.numpy().tobytes()
    if len(raw) < 8:
        raise ProtocolError("job frame shorter than its trailer")
    meta_len = int.from_bytes(raw[-8:], "little")
    if meta_len > len(raw) - 8:
        raise ProtocolError("job frame meta length out of range")
    try:
        meta = json.loads(raw[len(raw) - 8 - meta_len: len(raw) - 8])
        shapes = [tuple(int(x) for x in s) for s in meta["images"]]
        image_bytes = sum(int(torch.Size(s).numel()) for s in shapes)
        token_bytes = len(raw) - 8 - meta_len - image_bytes
        if token_bytes < 8 or token_bytes % 8:
            raise ProtocolError("job frame token section is not a whole int64 array")
        if vocab_size is not None:
            ids = np.frombuffer(raw, dtype=np.int64, count=token_bytes // 8)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ProtocolError(f"token ids must be in [0, {vocab_size})")
        tokens = array.array("q", raw[:token_bytes]).tolist()
        images, offset = [], token_bytes
        for shape in shapes:
            n = int(torch.Size(shape).numel())
            images.append(torch.frombuffer(bytearray(raw[offset: offset + n]), dtype=torch.uint8).view(shape))
            offset += n
        runs = meta["runs"]
        if runs is not None and (not isinstance(runs, list) or any(type(r) is not int for r in runs)
                                 or any(not 0 < r < len(tokens) for r in runs)
                                 or any(a >= b for a, b in zip(runs, runs[1:]))):
            raise ProtocolError("job frame runs are not increasing integers within (0, tokens)")
        return JobSpec(str(meta["request_id"]), tokens, dict(meta["params"]),
                       [int(t) for t in meta["output_token_ids"]], images, float(meta["budget"]),
                       int(meta["max_chunk_bytes"]), runs)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"malformed job frame: {exc}") from exc


def encode_logprob(logprob: TokenLogprob | None) -> bytes:
    """A first token's logprob as RESULT sends it (JSON: floats round-trip exactly); b"" for none."""
    if logprob is None:
        return b""
    return json.dumps([logprob.token_id, logprob.logprob, [list(t) for t in logprob.top]]).encode()


def decode_logprob(raw: bytes) -> TokenLogprob | None:
    if not raw:
        return None
    try:
        token_id, value, top = json.loads(raw)
        return TokenLogprob(int(token_id), float(value), tuple((int(t), float(v)) for t, v in top))
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed logprob: {exc}") from exc


def params_to_dict(params: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(params).items()}


# ---------------------------------------------------------------- chunk plan
@attrs.frozen
class Chunk:
    first_layer: int
    num_layers: int
    start: int  # first token
    count: int
    nbytes: int


@attrs.frozen
class KVLayout:
    """The per-token K/V geometry both sides must share."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def chunk_shape(self, chunk: Chunk) -> tuple[int, ...]:
        return (chunk.num_layers, 2, chunk.count, self.num_kv_heads, self.head_dim)


def chunk_plan(layout: KVLayout, num_tokens: int, max_chunk_bytes: int) -> list[Chunk]:
    """The chunks of a job of `num_tokens`, in sending order (see the module docstring)."""
    per_layer = num_tokens * layout.bytes_per_token_layer
    if per_layer <= max_chunk_bytes:
        group = max(1, min(layout.num_layers, max_chunk_bytes // per_layer))
        return [Chunk(first, min(group, layout.num_layers - first), 0, num_tokens,
                      min(group, layout.num_layers - first) * per_layer)
                for first in range(0, layout.num_layers, group)]
    tokens = max(1, max_chunk_bytes // layout.bytes_per_token_layer)
    return [Chunk(layer, 1, start, min(tokens, num_tokens - start),
                  min(tokens, num_tokens - start) * layout.bytes_per_token_layer)
            for layer in range(layout.num_layers) for start in range(0, num_tokens, tokens)]


# -------------------------------------------------------- compatibility record
#: record fields both sides settle on instead of having to agree (`transport_of`)
NEGOTIATED = frozenset({"transport"})


def compatibility_record(*, model_identity: str, layout: KVLayout, page_size: int, backend: str,
                         transport: str = "gloo") -> dict[str, Any]:
    """What both ends of a link must agree on, compared field by field at connect time, and the transport
    this side offers ("socket" or "gloo"; negotiated, `transport_of`)."""
    return {
        "protocol": PROTOCOL_VERSION, "model": model_identity, "dtype": str(layout.dtype).removeprefix("torch."),
        "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
        "page_size": page_size, "backend": backend, "transport": transport,
    }


def record_mismatch(mine: dict[str, Any], theirs: Any) -> str | None:
    """None if the records agree, else which fields differ (this side's value first)."""
    if not isinstance(theirs, dict):
        return "the peer sent no compatibility record"
    diffs = [f"{k} {mine[k]!r} here, {theirs.get(k)!r} there" for k in sorted(mine)
             if k not in NEGOTIATED and theirs.get(k) != mine[k]]
    return "; ".join(diffs) or None


def transport_of(mine: Mapping[str, object], theirs: Mapping[str, object]) -> str:
    """The transport a pair uses: kvlife's sockets where both sides offer them, else gloo (a peer that does
    not say, from before the socket transport, offers gloo); "nccl" with that backend (its chunks)."""
    if mine.get("backend") == "nccl":
        return "nccl"
    return "socket" if mine.get("transport") == theirs.get("transport") == "socket" else "gloo"


def model_identity(model_config: Any, config: Any) -> str:
    """A fingerprint of the model's shapes and, for the built-in seeded models, its seed.

    NOTE: a checkpoint is identified by its config, not its bytes: two
    checkpoints with the same config.json and different weights would pass.
    """
    described = json.dumps(attrs.asdict(model_config), sort_keys=True, default=str)
    seeded = config.model if "/" not in config.model and "\\" not in config.model else "checkpoint"
    digest = hashlib.sha256(f"{seeded}|{config.seed if seeded != 'checkpoint' else ''}|{described}".encode())
    return f"{seeded}:{digest.hexdigest()[:16]}"


# ------------------------------------------------------------------ proofs
def proof(secret: str | None, *parts: Any) -> str:
    """HMAC-SHA256 of the parts under the secret ('' without one)."""
    if secret is None:
        return ""
    message = "|".join(str(p) for p in parts).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def proof_ok(secret: str | None, presented: Any, *parts: Any) -> bool:
    if secret is None:
        return presented == ""
    return isinstance(presented, str) and hmac.compare_digest(presented, proof(secret, *parts))

"""Host <-> device traffic, written once: the step's read-back, pinned host
memory, and the stream every step and copy is ordered on.

`upload` is how small host arrays reach the device on a step's path: from
pinned memory, asynchronously (a copy from pageable memory waits for the
stream first). `read_back` is the only way code on a step's path reads device memory on
the host: the model runner calls it once per step (tokens, MoE routing and
logprobs together), HiSparse once per layer (the selected positions). On
CUDA each call is one device-to-host copy and one wait; on the host it
returns its inputs. The meta-device test (tests/test_meta_device.py)
replaces it to count the calls, which is how CI proves that a step reads
nothing else: every other host read of a `meta` tensor raises.

Pinned memory: torch's caching host allocator rounds every block up to a
power of two, so a large pool pinned through it can take twice its size.
`pinned_empty` pins an ordinary host tensor in place (`cudaHostRegister`,
exactly its bytes) for long-lived pools, and unregisters it when the tensor
is freed; small per-step buffers use the caching allocator, whose events
also keep a block from reuse while an asynchronous copy still reads it.

`compute_stream(device)` names the stream the engine's work runs on: the
device's default stream, for every thread (the event loop's, the step
worker's, the link threads'), so that side streams know what to wait for.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

#: dtypes `read_back` carries (as int64 words: integers widened, floats as float64 bits)
_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_FLOAT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def read_back(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`parts` on the host, as tensors of the same shapes and dtypes, with one
    device-to-host copy and one wait when they are on an accelerator.

    NOTE: the only host read on a step's path; see the module docstring.
    """
    if all(p.device.type == "cpu" for p in parts):
        return list(parts)
    words = pack_words(parts)
    if words.device.type != "cuda":
        return unpack_words(words.to("cpu"), parts)
    # NOTE: into pinned memory, then one wait for the stream: no hidden staging through pageable memory
    host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
    host.copy_(words, non_blocking=True)
    torch.cuda.current_stream(words.device).synchronize()
    return unpack_words(host, parts)


def pack_words(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`parts` flattened into one int64 tensor (on their device): integers widened, floats as float64 bits."""
    words = [_as_words(p) for p in parts]
    return torch.cat(words) if len(words) > 1 else words[0]


def unpack_words(words: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`pack_words`' inverse: tensors shaped and typed as `like`, from `words`."""
    out, start = [], 0
    for part in like:
        n = part.numel()
        out.append(_from_words(words[start : start + n], part))
        start += n
    return out


def _as_words(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    if t.dtype in _INTEGER:
        return flat.to(torch.int64)
    if t.dtype in _FLOAT:
        return flat.to(torch.float64).view(torch.int64)
    raise TypeError(f"read_back carries integer, bool and float tensors, not {t.dtype}")


def _from_words(words: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dtype in _FLOAT:
        words = words.view(torch.float64)
    return words.to(like.dtype).view(like.shape)


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` from the device into host memory: asynchronous on CUDA (into
    pinned `dst`, ordered on the current stream; its event or fence says when it is done),
    a plain copy elsewhere. NOTE: every device -> host copy that is not a read-back goes
    through here (the meta-device test counts them)."""
    dst.copy_(src, non_blocking=src.device.type == "cuda")


def to_host(src: torch.Tensor) -> torch.Tensor:
    """`src` in host memory, readable at once (`src` itself when it is there already; from
    CUDA a copy the caller waits for: off the step path only)."""
    if src.device.type == "cpu":
        return src
    cuda = src.device.type == "cuda"
    out = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
    copy_to_host(out, src)
    if cuda:
        torch.cuda.current_stream(src.device).synchronize()
    return out


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` on `device` without a host sync: on CUDA one asynchronous copy from a
    pinned buffer of torch's host allocator (which keeps the buffer until the copy has
    read it); on the host the array itself, as a tensor."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        staged.copy_(host)
        return staged.to(device, non_blocking=True)
    return host.to(device)


def pinned_empty(shape: Sequence[int], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, pinned exactly (no power-of-two rounding) when `pin`."""
    t = torch.zeros(tuple(shape), dtype=dtype)
    if pin and t.numel():
        pin_in_place(t)
    return t


def pin_in_place(t: torch.Tensor, register: Any = None) -> None:
    """Page-lock `t`'s memory where it is (`cudaHostRegister`), for as long as `t` lives
    (views that outlive `t` stay valid, only no longer pinned).

    `register` (tests) replaces the CUDA runtime: an object with
    ``cudaHostRegister(ptr, nbytes, flags)`` and ``cudaHostUnregister(ptr)``.
    """
    cudart = register if register is not None else torch.cuda.cudart()  # type: ignore[no-untyped-call, unused-ignore]
    ptr, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)


def compute_stream(device: torch.device) -> Any:
    """The stream the engine's work on `device` runs on (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.default_stream(device)


def on_device(device: torch.device) -> AbstractContextManager[Any]:
    """Make `device` current in this thread (CUDA; a no-op elsewhere): a step or copy
    issued from any thread lands on the engine's device, not on device 0."""
    if device.type != "cuda":
        return nullcontext()
    return torch.cuda.device(device)

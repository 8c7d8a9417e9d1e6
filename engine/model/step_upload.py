"""A step's inputs reach the device in one copy, from one pinned buffer.

The runner writes every small input of a step (token ids, positions, token
table rows, sampled rows, the sampler's fields) into sections of one host
int64 buffer, then `send` copies the used prefix to the device in one
asynchronous copy and returns its device view; the sections are slices of
that view::

    host (pinned on CUDA)  | ids T | positions T | slots | ... | fields 6 x S |
              one non_blocking copy, ordered on the compute stream
    device                 | same words                                       |

NOTE: the host buffer is reused every step. An event recorded after each
copy is waited for before the next step writes the buffer, so a copy still
reading it (a step that failed before its read-back) never sees the next
step's values; after a normal step the event is long done. On the host
(CPU) the sections are views of the host buffer itself, valid for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from resources.device_io import pinned_empty


class StepUpload:
    """One pinned host buffer and one host-to-device copy per step (see the module docstring)."""

    def __init__(self, device: torch.device, capacity: int = 4096) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copies = 0  # copies sent (tests and the sync count read it)
        self._event: Any = None
        self._host, self._np, self._dev = self._allocate(capacity)

    def _allocate(self, capacity: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor | None]:
        host = pinned_empty((capacity,), torch.int64, pin=self.cuda)
        dev = None if self.device.type == "cpu" else torch.empty(capacity, dtype=torch.int64, device=self.device)
        return host, host.numpy(), dev

    @property
    def capacity(self) -> int:
        return self._host.shape[0]

    def start(self, words: int) -> np.ndarray:
        """The host buffer (numpy view, at least `words` long) to write this step's inputs into."""
        if self._event is not None:
            if not self._event.query():  # NOTE: see the module docstring; done already after a normal step
                self._event.synchronize()
            self._event = None
        if words > self.capacity:
            self._host, self._np, self._dev = self._allocate(max(words, 2 * self.capacity))
        return self._np

    def send_sections(self, sizes: list[int]) -> Sequence[torch.Tensor]:
        """`send` of the first `sum(sizes)` words, as consecutive views of `sizes` words each,
        made in one call (on the host: views of the host buffer itself)."""
        words = sum(sizes)
        if self.device.type == "cpu":
            return self._host.split_with_sizes([*sizes, self.capacity - words])[: len(sizes)]
        return self.send(words).split_with_sizes(sizes)

    def send(self, words: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """The first `words` of the host buffer on the device (copied into `into[:words]` when given)."""
        src = self._host[:words]
        if self.device.type == "cpu" and into is None:
            return src
        dst = (into if into is not None else self._dev)
        assert dst is not None  # off the host there is always a device buffer
        dst = dst[:words]
        dst.copy_(src, non_blocking=self.cuda)
        self.copies += 1
        if self.cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
        return dst


class Sections:
    """Lays out named sections of a `StepUpload` buffer (offsets in int64 words)."""

    def __init__(self) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}
        self.size = 0

    def add(self, name: str, words: int) -> None:
        self.offsets[name] = (self.size, words)
        self.size += words

    def write(self, host: np.ndarray, name: str, values: Any) -> None:
        start, words = self.offsets[name]
        host[start : start + words] = values

    def section(self, host: np.ndarray, name: str) -> np.ndarray:
        """The host buffer's words of section `name` (a view: written after `write`, reads back)."""
        start, words = self.offsets[name]
        return host[start : start + words]

    def write_repeated(self, host: np.ndarray, name: str, values: np.ndarray, counts: np.ndarray) -> None:
        """Writes each of `values` `counts` times, in order (a row's value for each of its tokens)."""
        self.section(host, name)[:] = values.repeat(counts)

    def write_ranges(self, host: np.ndarray, name: str, shifts: np.ndarray, counts: np.ndarray) -> None:
        """Writes `t + shifts[r]` for each word t of the section, row r's `counts[r]` words in order
        (positions: a row's start less the step offset of its first token)."""
        out = self.section(host, name)
        np.add(np.arange(len(out), dtype=np.int64), shifts.repeat(counts), out=out)

    def view(self, dev: torch.Tensor, name: str) -> torch.Tensor:
        start, words = self.offsets[name]
        return dev[start : start + words]

"""The transfer benchmark's baseline: the same bytes in the same messages over a bare gloo pair, with no
engine on either side (`bench_disagg.py`'s transfer part; this file is also its sending child).

    python benchmarks/bare_gloo.py PORT MESSAGES NBYTES ROUNDS DISTINCT   # the sender (started by BareGloo)
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import torch

#: the most memory a side's distinct buffers take (the benchmark's largest jobs: 16 x 125 MiB)
DISTINCT_BYTES = 1 << 30


class BareGloo:
    """The same bytes in the same messages over a bare gloo pair: a child sends, this process receives.
    `distinct`: each message of a round from a buffer of its own into a buffer of its own (as each job's
    KV comes from and lands in pages of its own; at most `DISTINCT_BYTES` a side, then reused in turn);
    else all through one buffer on each side."""

    def __init__(self, messages: int, nbytes: int, rounds: int, *, distinct: bool) -> None:
        self.messages, self.nbytes = messages, nbytes
        self.store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                                                wait_for_workers=False)
        self.child = subprocess.Popen([sys.executable, __file__, str(self.store.port),
                                       str(messages), str(nbytes), str(rounds), str(int(distinct))],
                                      env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.pg = bare_group(self.store, 1)
        self.bufs = _buffers(_count(messages, nbytes, distinct), nbytes, 0)
        self.go = torch.zeros(1, dtype=torch.int64)

    def round(self) -> float:
        """Bytes per second of one round (the receiver's clock, from its go to the last byte)."""
        started = time.perf_counter()
        self.pg.send([self.go], 0, 0).wait()
        for i in range(self.messages):
            self.pg.recv([self.bufs[i % len(self.bufs)]], 0, 1).wait()
        return self.messages * self.nbytes / (time.perf_counter() - started)

    def close(self) -> None:
        """Wait for the sender to finish its rounds; one left waiting (the benchmark stopped early) is killed."""
        try:
            self.child.wait(10)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


def _count(messages: int, nbytes: int, distinct: bool | int) -> int:
    """How many buffers a side cycles through."""
    return max(1, min(messages, DISTINCT_BYTES // nbytes)) if distinct else 1


def _buffers(n: int, nbytes: int, fill: int) -> list[torch.Tensor]:
    return [torch.full((nbytes,), fill, dtype=torch.uint8) for _ in range(n)]


def bare_group(store, rank: int):
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=60)
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("bare/", store), rank, 2, options)


def bare_sender(port: int, messages: int, nbytes: int, rounds: int, distinct: int) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
    pg = bare_group(store, 0)
    bufs = _buffers(_count(messages, nbytes, distinct), nbytes, 1)
    go = torch.zeros(1, dtype=torch.int64)
    for _ in range(rounds):
        pg.recv([go], 1, 0).wait()
        for i in range(messages):
            pg.send([bufs[i % len(bufs)]], 1, 1).wait()


if __name__ == "__main__":
    bare_sender(*(int(a) for a in sys.argv[1:6]))

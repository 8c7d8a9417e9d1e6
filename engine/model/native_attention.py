"""kvlife's native CPU kernel for decode attention: every decode row of a step
over its paged K/V, read in place.

torch has no paged attention on CPU: its forms (`engine.model.paged_attend`)
gather a step's K (and V, or value bags) out of the pages before attending, a
dozen ops a layer, and at batch 32-128 that attention is as large as every
matmul of the step. `native/decode_attention.cpp` reads each row's keys and
values once, page by page, with a float32 softmax (transformers' eager
attention computes in float32 too): the bytes a decode step cannot avoid, in
one call a layer.

It is plain C++ with no torch headers, compiled on first use by the machine's
C++ compiler (``$CXX``, else ``g++``, ``c++`` or ``clang++``; about a second)
for this CPU (``-march=native``), cached under ``$KVLIFE_KERNEL_CACHE`` (else
``$XDG_CACHE_HOME/kvlife/kernels``, else ``~/.cache/kvlife/kernels``) by a
hash of the source, the flags, the compiler and the CPU, and loaded with
ctypes (which releases the GIL for the call). Where it cannot be built (no
compiler, a failed build) `load_decode_kernel` returns None, says why once in
the log (``kernel.unavailable``) and `kernel_problem` keeps the reason: the
engine then attends with torch (``EngineConfig.attention_kernel``: "auto"
falls back, "native" refuses to start).

It takes float32 queries, keys and values on the CPU, any page size, grouped
query heads and sliding windows; `DecodeKernel.takes` says whether a call
qualifies, and the caller uses torch otherwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch
from torch import Tensor

from engine.errors import InvalidConfig

log = structlog.get_logger("kvlife.model")

SOURCE = Path(__file__).with_name("native") / "decode_attention.cpp"

#: compile flags; -march=native is dropped on a compiler that refuses it
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-pthread")

#: from this many context tokens in a call (rows x longest context) on, the kernel splits the
#: rows over torch's intra-op thread count (a thread start costs tens of microseconds)
PARALLEL_MIN_TOKENS = 4096

class DecodeKernel:
    """The loaded kernel: ``kernel(q, k_buf, v_buf, columns, unit, kv_lens, window)``."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = library.kvlife_decode_attention_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                       ptr, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def takes(q: Tensor, k_buf: Tensor) -> bool:
        """Whether a call with queries `q` over the buffer `k_buf` qualifies (the caller checked
        the rest of the plan: decode rows, page or token columns)."""
        return (q.dtype == torch.float32 and k_buf.dtype == torch.float32 and q.device.type == "cpu"
                and k_buf.device.type == "cpu" and q.stride(-1) == 1 and k_buf.is_contiguous())

    def __call__(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, columns: Tensor, unit: int, kv_lens: Tensor,
                 window: int | None) -> Tensor:
        """`q` ``[B, H, D]`` (one query per row, at position ``kv_lens[b] - 1``) over the
        contexts in `k_buf` and `v_buf` ``[locations, KVH, D]`` (contiguous): row b's token j
        at ``columns[b, j // unit] * unit + j % unit``; returns ``[B, H, D]``."""
        rows, heads, head_dim = q.shape
        if columns.dtype != torch.int64 or columns.stride(-1) != 1:
            columns = columns.to(torch.int64).contiguous()
        if kv_lens.dtype != torch.int64 or not kv_lens.is_contiguous():
            kv_lens = kv_lens.to(torch.int64).contiguous()
        out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
        width = columns.shape[1] * unit
        threads = torch.get_num_threads() if rows * width >= PARALLEL_MIN_TOKENS else 1
        code = self._fn(q.data_ptr(), q.stride(0), q.stride(1), k_buf.data_ptr(), v_buf.data_ptr(),
                        columns.data_ptr(), columns.stride(0), unit, kv_lens.data_ptr(), rows, heads,
                        k_buf.shape[1], head_dim, window or 0, head_dim**-0.5, out.data_ptr(), threads)
        if code != 0:
            raise ValueError(f"decode attention kernel refused its arguments (code {code}): q {tuple(q.shape)}, "
                             f"kv heads {k_buf.shape[1]}")
        return out


class KernelBuild:
    """Builds and loads the kernel once (thread-safe); remembers why it could not."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir
        #: why the kernel could not be built or loaded (None: it was, or was not tried yet)
        self.problem: str | None = None
        self._kernel: DecodeKernel | None = None
        self._tried = False
        self._lock = threading.Lock()

    def load(self) -> DecodeKernel | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    path = _build(self.cache_dir or _cache_dir())
                    self._kernel = DecodeKernel(ctypes.CDLL(str(path)), path)
                except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
                    self.problem = str(exc) or type(exc).__name__
                    log.warning("kernel.unavailable", kernel="decode_attention", reason=self.problem,
                                detail="decode attention runs on torch's ops")
            return self._kernel


#: this process's build
BUILD = KernelBuild()


def load_decode_kernel() -> DecodeKernel | None:
    """The kernel, built and loaded once per process; None where it cannot be (see `kernel_problem`)."""
    return BUILD.load()


def kernel_problem() -> str | None:
    """Why `load_decode_kernel` returned None (None if it did not, or was not called)."""
    return BUILD.problem


#: `EngineConfig.attention_kernel`'s values
ATTENTION_KERNELS = ("auto", "native", "torch")


def decode_kernel_for(mode: str, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel an engine of `device` and model `dtype` attends its decode rows with under
    `EngineConfig.attention_kernel` `mode` (None: torch's ops); "native" where it does not apply
    or cannot be built raises `InvalidConfig` naming why (before any pool is allocated)."""
    if mode not in ATTENTION_KERNELS:
        raise InvalidConfig("EngineConfig.attention_kernel", f"one of {ATTENTION_KERNELS}", mode)
    applies = device.type == "cpu" and dtype == torch.float32
    if mode == "torch" or (mode == "auto" and not applies):
        return None
    if not applies:
        raise InvalidConfig("EngineConfig.attention_kernel",
                            f"'auto' or 'torch' for a {dtype} model on {device} (the kernel takes float32 on a CPU)",
                            mode)
    kernel = BUILD.load()
    if kernel is None and mode == "native":
        raise InvalidConfig("EngineConfig.attention_kernel",
                            f"'auto' or 'torch' here: the kernel could not be built ({BUILD.problem})", mode)
    return kernel


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++)")


def _cache_dir() -> Path:
    root = os.environ.get("KVLIFE_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvlife" / "kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(sorted(set(keep)))


def _build(cache_dir: Path) -> Path:
    compiler = _compiler()
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    errors: list[str] = []
    for arch in (("-march=native",), ()):
        flags = (*FLAGS, *arch)
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                         _cpu_identity().encode()])).hexdigest()[:20]
        target = cache_dir / f"decode_attention-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: built under a temporary name and renamed: processes building at once each get a whole file
        fd, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, str(SOURCE), "-o", temporary], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode == 0:
                os.replace(temporary, target)
                return target
            errors.append(f"{compiler} {' '.join(flags)}: {done.stderr.strip()[-400:]}")
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    raise RuntimeError("could not build the decode attention kernel: " + " | ".join(errors))

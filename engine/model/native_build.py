"""Building kvlife's native code into a library and loading it: the decode step's
CPU kernels (`engine/model/native/*.cpp`, the default `KernelBuild`) and the
link's socket transport (`engine/disagg/link/native/*.cpp`,
`engine.disagg.link.socket_transport`), each from its own directory.

The sources are plain C++ with no torch headers, compiled together on first
use by the machine's C++ compiler (``$CXX``, else ``g++``, ``c++`` or
``clang++``; about a second) for this CPU (``-march=native``; dropped on a
compiler that refuses it), cached under ``$KVLIFE_KERNEL_CACHE`` (else
``$XDG_CACHE_HOME/kvlife/kernels``, else ``~/.cache/kvlife/kernels``) by a
hash of the sources, the flags, the compiler and the CPU, and loaded with
ctypes (which releases the GIL for each call). The file is built under a
temporary name and renamed, so processes building at once each load a whole
one. Where it cannot be built (no compiler, a failed build) `KernelBuild.load`
returns None, says why once in the log (``kernel.unavailable``) and keeps the
reason in `KernelBuild.problem`.
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

log = structlog.get_logger("kvlife.model")

#: the kernels' sources: every ``*.cpp`` here goes into the one library (``*.h``: what they share)
SOURCES = Path(__file__).with_name("native")

#: compile flags; -march=native is tried first
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-pthread")


class KernelBuild:
    """Builds and loads the library once (thread-safe); remembers why it could not."""

    def __init__(self, cache_dir: Path | None = None, *, sources: Path = SOURCES, name: str = "kvlife_kernels",
                 flags: tuple[str, ...] = FLAGS, fallback: str = "the decode step runs on torch's ops alone") -> None:
        self.cache_dir = cache_dir
        #: the directory whose ``*.cpp`` (and ``*.h``) make the library, its file name's stem, and its flags
        self.sources, self.name, self.flags = sources, name, flags
        #: what runs instead where it cannot be built (said in the log)
        self.fallback = fallback
        #: why the library could not be built or loaded (None: it was, or was not tried yet)
        self.problem: str | None = None
        self.path: Path | None = None
        self._library: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    path = _build(self.cache_dir or _cache_dir(), self.sources, self.name, self.flags)
                    self._library, self.path = ctypes.CDLL(str(path)), path
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    self.problem = str(exc) or type(exc).__name__
                    log.warning("kernel.unavailable", library=self.name, reason=self.problem, detail=self.fallback)
            return self._library


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


def _build(cache_dir: Path, directory: Path, name: str, base_flags: tuple[str, ...]) -> Path:
    compiler = _compiler()
    sources = sorted(directory.glob("*.cpp"))
    if not sources:
        raise RuntimeError(f"no native sources in {directory}")
    headers = sorted(directory.glob("*.h"))  # NOTE: in the key too: a header change is a new library
    source = b"\0".join(path.name.encode() + b"\0" + path.read_bytes() for path in [*sources, *headers])
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    errors: list[str] = []
    for arch in (("-march=native",), ()):
        flags = (*base_flags, *arch)
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                         _cpu_identity().encode()])).hexdigest()[:20]
        target = cache_dir / f"{name}-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: built under a temporary name and renamed: processes building at once each get a whole file
        fd, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, *map(str, sources), "-o", temporary], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode == 0:
                os.replace(temporary, target)
                return target
            errors.append(f"{compiler} {' '.join(flags)}: {done.stderr.strip()[-400:]}")
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    raise RuntimeError(f"could not build {name}: " + " | ".join(errors))

"""A disk cache of NVRTC output, so a process compiles a given source once per machine (docs/mask_codegen.md).

Entries live in ``$FLASHJAX_CACHE_DIR`` (default ``~/.cache/flashjax``), under ``nvrtc/``, one file per binary,
named by a sha256 over everything that decides the bytes: the flashjax version, NVRTC's version, the target arch,
the options and the source. Files are written to a temporary name and renamed, so concurrent processes never see
a partial binary; a file that cannot be written leaves the cache off for that entry, not the call failed.

This runs at lowering / FFI-instantiate time, never from an execute handler (NVRTC takes tens to hundreds of ms).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path

from flashjax.nvrtc import compile_cuda, nvrtc_version

__all__ = ["CachedBinary", "cache_dir", "flashjax_version", "compile_cached"]


@dataclasses.dataclass(frozen=True)
class CachedBinary:
    kind: str  # "cubin" or "ptx"
    data: bytes
    arch: str
    key: str  # the sha256 naming the entry
    path: Path | None  # the cache file, None where it could not be written
    from_cache: bool  # read from disk (or this process's memory) rather than compiled now
    seconds: float  # what producing it took now: the compile, or the read


_memory: dict[str, CachedBinary] = {}
_lock = threading.Lock()


def flashjax_version() -> str:
    from flashjax import __version__  # imported here: this module may load while flashjax/__init__ runs

    return __version__


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHJAX_CACHE_DIR") or Path.home() / ".cache" / "flashjax")


def _key(source: str, arch: str, options: tuple[str, ...]) -> str:
    major, minor = nvrtc_version()
    header = f"flashjax {flashjax_version()}\nnvrtc {major}.{minor}\narch {arch}\noptions {' '.join(options)}\n"
    return hashlib.sha256((header + source).encode()).hexdigest()


def _write_atomically(path: Path, data: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            f.write(data)
        os.replace(f.name, path)
        return True
    except OSError:
        return False


def compile_cached(source: str, *, arch: str = "sm_90", options: tuple[str, ...] = (),
                   name: str = "flashjax_mask_mod.cu") -> CachedBinary:
    """``source`` compiled for ``arch`` by NVRTC, from this process's memory, the disk cache, or NVRTC."""
    key = _key(source, arch, tuple(options))
    with _lock:
        if key in _memory:
            return dataclasses.replace(_memory[key], from_cache=True, seconds=0.0)
    kind = "cubin" if arch.startswith("sm_") else "ptx"
    path = cache_dir() / "nvrtc" / f"{key}.{kind}"
    start = time.perf_counter()
    try:
        entry = CachedBinary(kind, path.read_bytes(), arch, key, path, True, time.perf_counter() - start)
    except OSError:
        binary = compile_cuda(source, arch=arch, name=name, options=tuple(options))
        stored = _write_atomically(path, binary.data)
        entry = CachedBinary(kind, binary.data, arch, key, path if stored else None, False, binary.seconds)
    with _lock:
        _memory[key] = entry
    return entry

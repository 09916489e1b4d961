"""NVRTC through ctypes: CUDA C++ source -> PTX or cubin, with no CUDA Python package (docs/mask_codegen.md).

The library is found, in order: ``$FLASHJAX_NVRTC`` (a path to libnvrtc.so), the NVIDIA CUDA wheels jax installs
(site-packages/nvidia/*/lib), the CUDA toolkit (``$CUDA_HOME``, ``$CUDA_PATH``, /usr/local/cuda), the loader's
search path. Compiling needs no GPU and no driver.

Compiling takes tens to hundreds of milliseconds: call it at lowering or FFI-instantiate time (through the cache in
flashjax.mask_codegen), never from an execute handler.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import glob
import os
import site
import sys
import time

__all__ = ["NvrtcError", "CudaBinary", "nvrtc_library_path", "nvrtc_version", "compile_cuda"]


class NvrtcError(RuntimeError):
    """NVRTC is missing or rejected the source; ``log`` holds NVRTC's program log (empty when it never ran)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message + (f"\nNVRTC log:\n{log}" if log else ""))
        self.log = log


@dataclasses.dataclass(frozen=True)
class CudaBinary:
    kind: str  # "cubin" (arch sm_XX) or "ptx" (arch compute_XX)
    data: bytes
    arch: str
    log: str  # NVRTC's warnings, if any
    seconds: float  # compile time


def _candidate_paths() -> list[str]:
    found = []
    site_dirs = list(sys.path) + list(getattr(site, "getsitepackages", list)()) + [site.getusersitepackages()]
    for directory in dict.fromkeys(site_dirs):  # jax's CUDA wheels: nvidia/cuda_nvrtc/lib, nvidia/cu13/lib, ...
        found += sorted(glob.glob(os.path.join(directory, "nvidia", "*", "lib", "libnvrtc.so*")))
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            found += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")))
    return [p for p in found if ".alt." not in os.path.basename(p)]


@functools.cache
def nvrtc_library_path() -> str | None:
    """The libnvrtc this process uses, or None where none is installed."""
    override = os.environ.get("FLASHJAX_NVRTC")
    if override:
        return override
    candidates = _candidate_paths()
    return candidates[0] if candidates else ctypes.util.find_library("nvrtc")


@functools.cache
def _library() -> ctypes.CDLL:
    path = nvrtc_library_path()
    if path is None:
        raise NvrtcError("flashjax: libnvrtc not found: install jax[cuda13] (its NVIDIA wheels ship NVRTC), or the "
                         "CUDA toolkit, or set FLASHJAX_NVRTC to the library's path")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NvrtcError(f"flashjax: cannot load NVRTC from {path}: {e}") from e
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(result: int, what: str, log: str = "") -> None:
    if result != 0:
        message = _library().nvrtcGetErrorString(result).decode()
        raise NvrtcError(f"flashjax: {what} failed: {message}", log)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _program_text(lib, program, size_fn, get_fn) -> bytes:
    size = ctypes.c_size_t()
    _check(size_fn(program, ctypes.byref(size)), size_fn.__name__)
    buffer = ctypes.create_string_buffer(size.value)
    _check(get_fn(program, buffer), get_fn.__name__)
    return buffer.raw[: size.value]


def compile_cuda(source: str, *, arch: str = "sm_90", name: str = "flashjax_mask_mod.cu",
                 options: tuple[str, ...] = ()) -> CudaBinary:
    """Compiles ``source`` for ``arch``: ``sm_XX`` gives a cubin, ``compute_XX`` PTX. Raises NvrtcError with the
    log when NVRTC rejects it."""
    if not (arch.startswith("sm_") or arch.startswith("compute_")):
        raise ValueError(f"arch must be sm_XX (cubin) or compute_XX (PTX), got {arch!r}")
    lib = _library()
    program = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        flags = [f"--gpu-architecture={arch}", "-std=c++17", *options]
        argv = (ctypes.c_char_p * len(flags))(*(f.encode() for f in flags))
        start = time.perf_counter()
        result = lib.nvrtcCompileProgram(program, len(flags), argv)
        seconds = time.perf_counter() - start
        log = _program_text(lib, program, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog)
        log = log.rstrip(b"\0").decode(errors="replace").strip()
        _check(result, f"NVRTC compiling {name} for {arch}", log)
        if arch.startswith("sm_"):
            data = _program_text(lib, program, lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            return CudaBinary("cubin", data, arch, log, seconds)
        data = _program_text(lib, program, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        return CudaBinary("ptx", data.rstrip(b"\0"), arch, log, seconds)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))

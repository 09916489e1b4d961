"""Loading the compiled library (ctypes, no Python ABI) and registering its XLA FFI targets.

The library is loaded once per process: a second copy from another path would register the same target names
twice, which XLA refuses. Nothing here needs a GPU: build information and the dispatch decision are plain C
functions, and the FFI targets are registered for the CUDA platform without touching a device.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import pathlib

import jax

LIBRARY_ENV = "FLASHJAX_LIBRARY"
LIBRARY_NAME = "libflashjax.so"
# FFI target names: stable, so that jax.export'ed calls keep resolving.
FWD_TARGET = "flashjax_fwd"
FWD_SPLIT_TARGET = "flashjax_fwd_split"  # the forward with split keys and its workspace (primitives.py)
BWD_TARGET = "flashjax_bwd"

# Enum values shared with csrc/ffi/dispatch.h and csrc/include/flashjax/params.h.
DIRECTION = {"fwd": 0, "bwd": 1}
DTYPE = {"float16": 0, "bfloat16": 1}


class LibraryNotFound(RuntimeError):
    pass


def library_path() -> pathlib.Path | None:
    """Where the library is: $FLASHJAX_LIBRARY, else next to this file (wheels and dev builds put it there)."""
    env = os.environ.get(LIBRARY_ENV)
    candidates = [pathlib.Path(env)] if env else [pathlib.Path(__file__).with_name(LIBRARY_NAME)]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    return None


@functools.cache
def library() -> ctypes.CDLL:
    path = library_path()
    if path is None:
        raise LibraryNotFound(
            f"flashjax's compiled library ({LIBRARY_NAME}) was not found next to {__file__} "
            f"nor at ${LIBRARY_ENV}; build it with `pip install .` or see the README's build section")
    lib = ctypes.CDLL(str(path))
    lib.flashjax_build_info.restype = ctypes.c_char_p
    lib.flashjax_choose_kernel.restype = ctypes.c_int
    lib.flashjax_choose_kernel.argtypes = [ctypes.c_int] * 6 + [ctypes.c_char_p, ctypes.c_int]
    lib.flashjax_padded_head_dim.restype = ctypes.c_int
    lib.flashjax_padded_head_dim.argtypes = [ctypes.c_int]
    return lib


def available() -> bool:
    try:
        library()
    except (LibraryNotFound, OSError):
        return False
    return True


@functools.cache
def build_info() -> dict:
    """The library's own description: version, CUDA archs, kernel set and table (no GPU needed)."""
    info = json.loads(library().flashjax_build_info().decode())
    info["path"] = str(library_path())
    return info


def _choose(device_sm: int, direction: str, dtype: str, head_dim: int, varlen: bool, mask_mod: bool):
    reason = ctypes.create_string_buffer(512)
    index = library().flashjax_choose_kernel(device_sm, DIRECTION[direction], DTYPE[dtype], head_dim,
                                             int(varlen), int(mask_mod), reason, len(reason))
    return index, reason.value.decode()


def choose_kernel(device_sm: int, direction: str, dtype: str, head_dim: int, *, varlen: bool = False,
                  mask_mod: bool = False) -> tuple[bool, str]:
    """Ask the library's dispatcher (the same function the FFI handlers use) whether a kernel runs this call."""
    index, reason = _choose(device_sm, direction, dtype, head_dim, varlen, mask_mod)
    return index >= 0, reason


def chosen_family(device_sm: int, direction: str, dtype: str, head_dim: int, *, varlen: bool = False,
                  mask_mod: bool = False) -> str | None:
    """The kernel family ("sm80", "sm90") dispatch picks for this call, or None where no kernel runs it."""
    index, _ = _choose(device_sm, direction, dtype, head_dim, varlen, mask_mod)
    fn = library().flashjax_kernel_family
    fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_int]
    return fn(index).decode() or None


def padded_head_dim(head_dim: int) -> int:
    return library().flashjax_padded_head_dim(head_dim)


def sm90_fwd_pack_group(seqlen_q: int, heads_q: int, heads_k: int) -> int:
    """Query heads per tile the sm90 forward uses for these sizes: Hq / Hk where it packs GQA, else 1."""
    fn = library().flashjax_sm90_fwd_pack_group
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int] * 3
    return fn(seqlen_q, heads_q, heads_k)


def sm90_fwd_num_splits(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int,
                        window_left: int, softcap: bool, num_sms: int) -> int:
    """Parts per tile the sm90 forward splits a call's keys into on a GPU of num_sms SMs (1: no split); head_dim is
    the compiled width. 1 with a library that predates split keys. softcap matters only to libraries whose split
    kernel had no capped twin (they answer 1 for capped calls)."""
    lib = library()
    if not hasattr(lib, "flashjax_sm90_fwd_num_splits"):
        return 1
    fn = lib.flashjax_sm90_fwd_num_splits
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int] * 9
    return fn(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, window_left, int(softcap), num_sms)


def default_device() -> tuple[int, int] | None:
    """(compute capability as major*10 + minor, SM count) of the default device when it is an NVIDIA GPU, else
    None. The SM count is 0 where jax does not report it."""
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if cc is None:
        return None
    major, minor = str(cc).split(".")
    return int(major) * 10 + int(minor), int(getattr(device, "core_count", 0) or 0)


def max_smem_per_block_optin(device_sm: int) -> int:
    """Bytes of shared memory per block that dispatch allows a kernel on a GPU of this compute capability."""
    fn = library().flashjax_max_smem_per_block_optin
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn(device_sm)


@functools.cache
def register_targets() -> None:
    """Register the FFI handlers with XLA for the CUDA platform (once; idempotent per process)."""
    lib = library()
    for name in (FWD_TARGET, BWD_TARGET, FWD_SPLIT_TARGET):
        if name == FWD_SPLIT_TARGET and not hasattr(lib, name):
            continue  # a library before split keys: sm90_fwd_num_splits answers 1, so nothing lowers to it
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="CUDA")

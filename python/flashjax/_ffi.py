"""Loading the compiled library (ctypes, no Python ABI) and registering its XLA FFI targets.

The library is loaded once per process: a second copy from another path would register the same target names
twice, which XLA refuses. Nothing here needs a GPU: build information and the plan of a call are plain C functions,
and the FFI targets are registered for the CUDA platform without touching a device.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.metadata
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
BWD_DETERMINISTIC_TARGET = "flashjax_bwd_deterministic"  # deterministic=True: with the dq ordering counters
FWD_VARLEN_TARGET = "flashjax_fwd_varlen"  # packed sequences (varlen_kernel.py)
# the same with the tile counter of the run-time walk (FLASHJAX_SM90_VARLEN_WALK=2) as its workspace
FWD_VARLEN_DYNAMIC_TARGET = "flashjax_fwd_varlen_dynamic"
BWD_VARLEN_TARGET = "flashjax_bwd_varlen"
TANGENT_TARGET = "flashjax_tangent"  # forward mode: the tangent primitive (primitives.py)
TANGENT_VARLEN_TARGET = "flashjax_tangent_varlen"  # its varlen twin (varlen_kernel.py)
FWD_MASK_MOD_TARGET = "flashjax_fwd_mask_mod"  # a mask mod's bits and the tile-class workspace (issue 38)
BWD_MASK_MOD_TARGET = "flashjax_bwd_mask_mod"
BWD_MASK_MOD_DETERMINISTIC_TARGET = "flashjax_bwd_mask_mod_deterministic"  # with the dq ordering counters
JVP_TARGET = "flashjax_jvp"  # jax.jvp's fused pass: out, lse and their tangents in one kernel (primitives.py)
TANGENT_MASK_MOD_TARGET = "flashjax_tangent_mask_mod"  # jax.jvp of a mask-mod call (issue 39)
FWD_VARLEN_MASK_MOD_TARGET = "flashjax_fwd_varlen_mask_mod"  # varlen with a mask mod's padded bits (varlen_kernel.py)
BWD_VARLEN_MASK_MOD_TARGET = "flashjax_bwd_varlen_mask_mod"
KERNEL_TARGETS = (FWD_TARGET, BWD_TARGET, FWD_SPLIT_TARGET, BWD_DETERMINISTIC_TARGET, FWD_VARLEN_TARGET,
                  BWD_VARLEN_TARGET, TANGENT_TARGET, TANGENT_VARLEN_TARGET, FWD_MASK_MOD_TARGET, BWD_MASK_MOD_TARGET,
                  JVP_TARGET, FWD_VARLEN_DYNAMIC_TARGET, TANGENT_MASK_MOD_TARGET, FWD_VARLEN_MASK_MOD_TARGET,
                  BWD_VARLEN_MASK_MOD_TARGET, BWD_MASK_MOD_DETERMINISTIC_TARGET)
MASK_BITS_TARGET = "flashjax_mask_bits"  # registered by mask_bits.py with its own state type
ALL_TARGETS = KERNEL_TARGETS + (MASK_BITS_TARGET,)

# flashjax::DType's values (csrc/include/flashjax/params.h).
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


class _Problem(ctypes.Structure):
    """csrc/ffi/c_api.cpp's flashjax_problem."""
    _fields_ = [(name, ctypes.c_int32) for name in (
        "struct_size", "dtype", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_k", "head_dim", "window_left",
        "window_right")] + [("softcap", ctypes.c_float)] + [(name, ctypes.c_int32) for name in (
            "has_sinks", "varlen", "mask_mod", "deterministic", "num_splits", "mask_seqlen_q", "mask_seqlen_k")]


class _Device(ctypes.Structure):
    """csrc/ffi/c_api.cpp's flashjax_device."""
    _fields_ = [(name, ctypes.c_int32) for name in ("struct_size", "sm", "smem_per_block_optin", "num_sms")]


@functools.cache
def library() -> ctypes.CDLL:
    path = library_path()
    if path is None:
        raise LibraryNotFound(
            f"flashjax's compiled library ({LIBRARY_NAME}) was not found next to {__file__} "
            f"nor at ${LIBRARY_ENV}; build it with `pip install .` or see the README's build section")
    lib = ctypes.CDLL(str(path))
    lib.flashjax_build_info.restype = ctypes.c_char_p
    lib.flashjax_plan.restype = ctypes.c_int
    lib.flashjax_plan.argtypes = [ctypes.POINTER(_Problem), ctypes.POINTER(_Device), ctypes.c_char_p, ctypes.c_int]
    return lib


def available() -> bool:
    try:
        library()
    except (LibraryNotFound, OSError, AttributeError):
        return False
    return True


@functools.cache
def build_info() -> dict:
    """The library's own description: version, CUDA archs, kernel set and table, settings (no GPU needed)."""
    info = json.loads(library().flashjax_build_info().decode())
    info["path"] = str(library_path())
    return info


@functools.lru_cache(maxsize=4096)
def plan(*, dtype: str, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int,
         window_left: int = -1, window_right: int = -1, softcap: float = 0.0, has_sinks: bool = False,
         varlen: bool = False, mask_mod: bool = False, deterministic: bool = False, num_splits: int = 0,
         device_sm: int, num_sms: int = 0, mask_seqlen_q: int = 0, mask_seqlen_k: int = 0) -> dict:
    """The library's plan of a call (csrc/ffi/plan.h: the function the FFI handlers also ask): whether the kernels
    run it ("runs", "reason"), the compiled head width, and per pass ("fwd", "bwd", "tangent") the family and the shared memory
    per block of its row ("smem_bytes", 0 where no kernel runs), its tile, GQA packing and key-split choices with their
    reasons, and the workspace shapes of the pass's FFI call. head_dim is the call's
    own width; dtype a numpy name ("bfloat16", "float16"); num_sms 0 when unknown (then no call splits by rule).
    mask_seqlen_q / mask_seqlen_k: a varlen call's mask-bit grid (the max_seqlen hints), which sizes its tile classes."""
    problem = _Problem(ctypes.sizeof(_Problem), DTYPE[dtype], batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim,
                       window_left, window_right, softcap, has_sinks, varlen, mask_mod, deterministic, num_splits,
                       mask_seqlen_q, mask_seqlen_k)
    device = _Device(ctypes.sizeof(_Device), device_sm, 0, num_sms)
    size = 4096
    while True:
        text = ctypes.create_string_buffer(size)
        needed = library().flashjax_plan(ctypes.byref(problem), ctypes.byref(device), text, size)
        if needed < 0:
            raise RuntimeError(f"flashjax: the library at {library_path()} does not match this Python package "
                               f"(flashjax_plan refused its structs); reinstall both together")
        if needed < size:
            return json.loads(text.value.decode())
        size = needed + 1


def default_device() -> tuple[int, int] | None:
    """(compute capability as major*10 + minor, SM count) of the default device when it is an NVIDIA GPU, else
    None. The SM count is 0 where jax does not report it."""
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if cc is None:
        return None
    major, minor = str(cc).split(".")
    return int(major) * 10 + int(minor), int(getattr(device, "core_count", 0) or 0)


@functools.cache
def register_targets() -> None:
    """Register the FFI handlers with XLA for the CUDA platform (once; idempotent per process)."""
    lib = library()
    for name in KERNEL_TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="CUDA")


def export_checks() -> list:
    """What jax.export needs to accept flashjax's custom calls: one DisabledSafetyCheck per FFI target (jax.export
    refuses custom calls whose targets it does not know; ours are stable, see docs/design.md 3.8). Use as
    `jax.export.export(jax.jit(f), disabled_checks=flashjax.export_checks())`."""
    from jax import export
    return [export.DisabledSafetyCheck.custom_call(name) for name in ALL_TARGETS]


# ------------------------------------------------------------------------------------------ CUDA environment
CUDA_MAJORS = (12, 13)  # the jax CUDA plugins flashjax is built for, one wheel each (flashjax-cu12, flashjax-cu13)


def jax_cuda_plugins() -> dict[int, str]:
    """The jax CUDA plugins installed, {CUDA major: version}: what decides which flashjax wheel matches."""
    found = {}
    for major in CUDA_MAJORS:
        try:
            found[major] = importlib.metadata.version(f"jax-cuda{major}-plugin")
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


@functools.cache
def driver_cuda_version() -> int | None:
    """The CUDA version the NVIDIA driver supports (e.g. 13000 for 13.0), or None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def cuda_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


@functools.cache
def cuda_environment() -> dict:
    """How the library's CUDA major fits this environment: {"library", "driver", "plugins", "problem", "warning"}.

    "problem" (the kernels cannot run: a driver older than the library's CUDA) sends every call to the reference
    with that reason, and import raises it where a jax CUDA plugin is installed; "warning" (the jax plugin is of
    another CUDA major than the library, which runs but is not what was tested) is said once at import."""
    library_version = build_info()["cuda_version"]
    major = library_version // 1000
    driver = driver_cuda_version()
    plugins = jax_cuda_plugins()
    problem = warning = None
    if driver is not None and driver < major * 1000:
        problem = (f"this flashjax library was built with CUDA {cuda_text(library_version)} but the NVIDIA driver "
                   f"supports CUDA {cuda_text(driver)} at most: update the driver"
                   + (f", or install flashjax-cu{driver // 1000} next to jax[cuda{driver // 1000}]"
                      if driver // 1000 in CUDA_MAJORS else ""))
    elif plugins and major not in plugins:
        other = ", ".join(f"jax-cuda{m}-plugin {v}" for m, v in sorted(plugins.items()))
        wanted = " or ".join(f"flashjax-cu{m}" for m in sorted(plugins))
        warning = (f"this flashjax library was built with CUDA {major} but JAX's CUDA plugin is {other}; "
                   f"install {wanted} to match it (or jax[cuda{major}])")
    return {"library": library_version, "driver": driver, "plugins": plugins, "problem": problem,
            "warning": warning}


def check_environment() -> None:
    """Import-time check (where a jax CUDA plugin is installed and the library is there): a library the driver
    cannot run raises ImportError now rather than failing at the first kernel launch; a plugin of another CUDA
    major warns. Without a plugin (a CPU-only jax) or without the library only the reference runs anyway."""
    if not jax_cuda_plugins() or not available():
        return
    env = cuda_environment()
    if env["problem"]:
        raise ImportError("flashjax: " + env["problem"])
    if env["warning"]:
        import warnings
        warnings.warn("flashjax: " + env["warning"], stacklevel=3)

"""GPU tests: run only where JAX sees an NVIDIA GPU and the library has kernels; skip cleanly elsewhere."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Every sweep case compiles new shapes: XLA's GEMM autotuning (of the reference's matmuls) would dominate the run.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_autotune_level=0")

import jax  # noqa: E402
import pytest  # noqa: E402


def _gpu_ready():
    if os.environ.get("FLASHJAX_TESTS_PINNED_CPU") == "1":
        return False, ("the CPU tests pinned JAX to the CPU in this process: run tests/gpu in a pytest process of "
                       "its own (tools/test.sh does)")
    try:
        devices = jax.devices()
    except RuntimeError:
        return False, "JAX sees no device"
    if devices[0].platform != "gpu":
        return False, f"no GPU (default device is {devices[0].platform})"
    from flashjax import _ffi
    if not _ffi.available():
        return False, "libflashjax.so not built"
    if not _ffi.build_info()["kernels"]:
        return False, "the library was built without kernels"
    return True, ""


_READY, _WHY = _gpu_ready()


def pytest_collection_modifyitems(config, items):
    if _READY:
        return
    skip = pytest.mark.skip(reason=f"GPU tests: {_WHY}")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)

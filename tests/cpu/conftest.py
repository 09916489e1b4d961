import os

if "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"
    # tests/gpu/conftest.py reads this to say why GPU tests collected in the same process cannot run.
    os.environ["FLASHJAX_TESTS_PINNED_CPU"] = "1"
# The sharding tests (test_sharding.py, test_ring.py) split calls over 8 virtual CPU devices. XLA reads the flag when
# JAX creates its CPU client, so it is set here, before any test imports jax; every other test runs on device 0 as
# before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@contextlib.contextmanager
def _bench_script(filename, module_name):
    """Imports bench/<filename> as `module_name`, with bench/ on sys.path while it is in use (its scripts import
    their neighbours, as when they run as scripts)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / filename)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="session")
def bench_script():
    """_bench_script, for the tests of bench/'s scripts."""
    return _bench_script

"""Shared test set-up: CPU tests force the CPU platform; GPU tests (tests/gpu) need an NVIDIA GPU."""
import os
import pathlib
import sys

# Running from a checkout without installing: import python/flashjax.
_PYTHON_DIR = pathlib.Path(__file__).resolve().parents[1] / "python"
if str(_PYTHON_DIR) not in sys.path and os.environ.get("FLASHJAX_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(_PYTHON_DIR))

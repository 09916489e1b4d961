"""A short kernel run through JAX for compute-sanitizer's memcheck: fixed ragged configs, forward and backward.

Run as: compute-sanitizer --tool memcheck --kernel-name kns=flashjax python tests/gpu/sanitize.py
racecheck crashes on a JAX process; it and synccheck (and memcheck again) run on tests/sanitize's C++ driver,
which launches the same kernels with no Python or XLA (tools/device_check.sh sanitize runs both).
XLA_PYTHON_CLIENT_ALLOCATOR=platform makes every buffer its own allocation, so an out-of-bounds access is not
hidden inside a pooled block.
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# No autotuning and no CUDA-graph command buffers: the sanitizer should see plain launches of our kernels only.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import sweep  # noqa: E402

CONFIGS = [
    sweep.Config("bfloat16", 2, 77, 133, 4, 2, 64, 64, True, (-1, -1), True, 0.0),
    sweep.Config("float16", 1, 200, 65, 2, 1, 128, 128, False, (16, 3), False, 5.0),
    sweep.Config("bfloat16", 1, 1, 300, 8, 1, 256, 256, False, (-1, -1), True, 0.0),
    sweep.Config("bfloat16", 1, 150, 0, 2, 2, 96, 96, True, (-1, -1), False, 0.0),
    sweep.Config("float16", 2, 129, 129, 4, 4, 192, 192, True, (0, 0), True, 0.0),
]


def main():
    failures = 0
    for i, cfg in enumerate(CONFIGS):
        rng = np.random.default_rng(i)
        inputs = sweep.make_inputs(cfg, rng)
        kernel = sweep.run(cfg, inputs, "kernel")
        bad = sweep.check(cfg, sweep.compare(cfg, kernel, sweep.run(cfg, inputs, "reference")))
        print(f"{cfg}: {'ok' if not bad else bad}")
        failures += bool(bad)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

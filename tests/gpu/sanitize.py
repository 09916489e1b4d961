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
    sweep.Config(dtype="bfloat16", batch=2, seqlen_q=77, seqlen_k=133, heads_q=4, heads_k=2, head_dim=64,
                 causal=True, sinks=True),
    sweep.Config(dtype="float16", batch=1, seqlen_q=200, seqlen_k=65, heads_q=2, heads_k=1, head_dim=128,
                 window_size=(16, 3), softcap=5.0),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=1, seqlen_k=300, heads_q=8, heads_k=1, head_dim=256, sinks=True),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=150, seqlen_k=0, heads_q=2, heads_k=2, head_dim=96, causal=True),
    sweep.Config(dtype="float16", batch=2, seqlen_q=129, seqlen_k=129, heads_q=4, heads_k=4, head_dim=192,
                 causal=True, window_size=(0, 0), sinks=True),
    # The sm90 backward's D 96 (128-key CTAs, dQ N = 48) and D 256 (64-key CTAs, one Q / dO stage, dQ in two slices).
    sweep.Config(dtype="float16", batch=1, seqlen_q=200, seqlen_k=77, heads_q=2, heads_k=2, head_dim=96,
                 window_size=(32, 7)),
    sweep.Config(dtype="bfloat16", batch=1, seqlen_q=130, seqlen_k=200, heads_q=4, heads_k=2, head_dim=256,
                 causal=True, softcap=5.0),
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

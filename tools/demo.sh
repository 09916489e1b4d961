#!/usr/bin/env bash
# The main job: a GQA causal attention with sinks, forward and backward, compared with the reference; on an
# NVIDIA GPU it also times the kernel against jax.nn.dot_product_attention(implementation="cudnn").
set -euo pipefail
cd "$(dirname "$0")/.."
tools/env.sh
if [ ! -f python/flashjax/libflashjax.so ]; then
  FLASHJAX_KERNEL_SET=${FLASHJAX_KERNEL_SET:-ci} FLASHJAX_CUDA_ARCHS=${FLASHJAX_CUDA_ARCHS:-80-real} tools/build.sh
fi
PYTHONPATH=python .venv/bin/python examples/demo.py "$@"

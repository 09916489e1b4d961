#!/usr/bin/env bash
# The main job: a GQA causal attention with sinks, forward and backward, compared with the reference; on an
# NVIDIA GPU it also times the kernel against jax.nn.dot_product_attention(implementation="cudnn").
set -euo pipefail
cd "$(dirname "$0")/.."
tools/env.sh
VENV=$(realpath "${FLASHJAX_VENV:-.venv}")
# The same library as tools/test.sh's (incremental: nothing recompiles when it is current).
if [ -z "$(tools/gpu.sh arch)" ]; then
  export FLASHJAX_KERNEL_SET=${FLASHJAX_KERNEL_SET:-ci} FLASHJAX_CUDA_ARCHS=${FLASHJAX_CUDA_ARCHS:-80-real}
fi
tools/build.sh
PYTHONPATH=python "$VENV/bin/python" examples/demo.py "$@"

#!/usr/bin/env bash
# The test suite, from a fresh machine: environment, generated-file check, library build (every kernel for this
# machine's GPU; the small CI set without one; FLASHJAX_KERNEL_SET/FLASHJAX_CUDA_ARCHS override), GoogleTest host
# tests, then pytest: the CPU tests and lab/tests (the lab tools' own tests) always, the GPU tests in a second
# process (they skip without an NVIDIA GPU). Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/env.sh
VENV=$(realpath "${FLASHJAX_VENV:-.venv}")
export PATH="$VENV/bin:$PATH"
python tools/gen_kernels.py --check
# With an NVIDIA GPU: every kernel, for that GPU's architecture (tools/build.sh's defaults). Without one: the
# small CI set for sm80, which is enough for the host tests and the CPU tests that load the library.
if [ -z "$(tools/gpu.sh arch)" ]; then
  export FLASHJAX_KERNEL_SET=${FLASHJAX_KERNEL_SET:-ci} FLASHJAX_CUDA_ARCHS=${FLASHJAX_CUDA_ARCHS:-80-real}
fi
tools/build.sh
BUILD=$(cat build/last)
(cd "$BUILD" && ctest --output-on-failure)
python -m pytest -q -n "${FLASHJAX_TEST_JOBS:-2}" tests/cpu lab/tests "$@"
# The GPU tests in a process of their own, since the CPU tests pin JAX to the CPU for their whole process. Without
# a GPU they are collected and skip (so CI still imports them).
JOBS=$(( $(nproc) / 2 )); JOBS=$(( JOBS < 1 ? 1 : JOBS > 8 ? 8 : JOBS ))
python -m pytest -q -n "${FLASHJAX_GPU_TEST_JOBS:-$JOBS}" tests/gpu "$@"

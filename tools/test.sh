#!/usr/bin/env bash
# The test suite, from a fresh machine: environment, generated-file check, library build (the small CI kernel set
# unless FLASHJAX_KERNEL_SET says otherwise), GoogleTest host tests, then pytest (CPU tests and lab/tests, the lab
# tools' own tests, always; GPU tests run when JAX sees an NVIDIA GPU and skip otherwise). Extra arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/env.sh
export PATH="$PWD/.venv/bin:$PATH"
python tools/gen_kernels.py --check
FLASHJAX_KERNEL_SET=${FLASHJAX_KERNEL_SET:-ci} FLASHJAX_CUDA_ARCHS=${FLASHJAX_CUDA_ARCHS:-80-real} tools/build.sh
BUILD=$(cat build/last)
(cd "$BUILD" && ctest --output-on-failure)
python -m pytest -q -n "${FLASHJAX_TEST_JOBS:-2}" tests lab/tests "$@"

#!/usr/bin/env bash
# Builds libflashjax.so with CMake into build/<kernel set>/ and copies it next to python/flashjax/__init__.py,
# where _ffi.py finds it when flashjax runs from the checkout. Incremental: only changed files recompile.
#   FLASHJAX_KERNEL_SET=full|ci|bench|none   (default full; bench: sm90 forward + sm80 backward, bf16, D 64/128/256, for
#                                            kernel experiments with lab/tools/compare_builds.sh)
#   FLASHJAX_CUDA_ARCHS="80-real;90a-real"   (default: this machine's GPU, e.g. "90a-real" on a Hopper, or
#                                            "80-real;90a-real" without one; "release" is the wheels' set)
#   FLASHJAX_BUILD_JOBS=N   parallel compile jobs (default: all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
tools/env.sh
SET=${FLASHJAX_KERNEL_SET:-full}
ARCHS=${FLASHJAX_CUDA_ARCHS:-$(tools/gpu.sh arch)}
ARCHS=${ARCHS:-80-real;90a-real}
BUILD=build/${SET}-${ARCHS//;/_}
VENV=$(realpath "${FLASHJAX_VENV:-.venv}")
export PATH="$VENV/bin:$PATH"
cmake -S . -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$VENV/bin/python" -DFLASHJAX_KERNEL_SET="$SET" \
  -DFLASHJAX_CUDA_ARCHS="$ARCHS" -DFLASHJAX_BUILD_TESTS=ON -DCMAKE_CUDA_COMPILER="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}" >/dev/null
ninja -C "$BUILD" -j "${FLASHJAX_BUILD_JOBS:-$(nproc)}"
cp "$BUILD/libflashjax.so" python/flashjax/libflashjax.so
echo "$BUILD" > build/last
echo "flashjax: built $BUILD/libflashjax.so (kernels: $SET, archs: $ARCHS)"
# Whether the D 128 forward kept its recorded hot loop (lab/hot_loop_fingerprint.txt): its register allocation is
# worth 1.3-3% of that kernel's cycles and moves with any kernel edit (docs/performance.md). Only for the sets that
# have that kernel; a note, never a failure (without cuobjdump, which lab/tools/sass.sh installs, the tool says so).
if [[ $ARCHS == *90a* && $SET != ci && $SET != none ]]; then
  "$VENV/bin/python" lab/tools/hot_loop_diff.py "$BUILD/libflashjax.so" --fingerprint \
    --expect lab/hot_loop_fingerprint.txt 2>&1 | sed 's/^/flashjax: /' || true
fi

#!/usr/bin/env bash
# Creates (or reuses) the virtual environment the other tools run in: Python >= 3.12, jax at a tested version, the
# jax CUDA plugin of the toolkit's major when this machine has an NVIDIA GPU (so that JAX sees it), and the
# packages the build and the tests need. Idempotent: a venv that already holds all of it is left as it is.
#   FLASHJAX_VENV=.venv              where the venv lives
#   FLASHJAX_JAX=0.11.2              the jax version (the library's FFI headers come from 0.11.2; CI also runs the
#                                    CPU tests with the newest tested jax, see pyproject.toml's range)
#   FLASHJAX_CUDA_MAJOR=12|13|none   which jax CUDA plugin to install (default: nvcc's major when a GPU is present,
#                                    none otherwise)
#   FLASHJAX_SYSTEM_SITE_PACKAGES=1  let the venv see the system's packages: for a machine whose python3 already has
#                                    jax with its CUDA plugin (for instance one without network)
#   FLASHJAX_WHEELHOUSE=DIR          install from this folder of wheels alone (no network); the README says what it
#                                    must hold
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLASHJAX_VENV:-.venv}
JAX_VERSION=${FLASHJAX_JAX:-0.11.2}
CUTLASS=nvidia-cutlass==4.2.0.0
if [ -z "${FLASHJAX_CUDA_MAJOR:-}" ]; then
  FLASHJAX_CUDA_MAJOR=none
  if [ -n "$(tools/gpu.sh arch)" ]; then
    FLASHJAX_CUDA_MAJOR=$(tools/gpu.sh cuda-major)
    if [ -z "$FLASHJAX_CUDA_MAJOR" ]; then
      echo "flashjax: this machine has an NVIDIA GPU but no CUDA toolkit (nvcc): install one (12.8 or newer)," \
           "or set CUDACXX to its nvcc" >&2
      exit 1
    fi
  fi
fi
case $FLASHJAX_CUDA_MAJOR in
  12|13) JAX_REQUIREMENT="jax[cuda$FLASHJAX_CUDA_MAJOR]==$JAX_VERSION"; PLUGIN="jax-cuda$FLASHJAX_CUDA_MAJOR-plugin" ;;
  none) JAX_REQUIREMENT="jax==$JAX_VERSION"; PLUGIN="" ;;
  *) echo "flashjax: FLASHJAX_CUDA_MAJOR must be 12, 13 or none, got '$FLASHJAX_CUDA_MAJOR'" >&2; exit 1 ;;
esac
PACKAGES=("$JAX_REQUIREMENT" "jaxlib==$JAX_VERSION" numpy pytest pytest-xdist flatbuffers)

find_python() {
  for candidate in python3.13 python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
                   "$HOME"/.pyenv/versions/3.13*/bin/python3.13 /usr/local/bin/python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

# Whether the venv has everything: the pinned jax, the plugin when one is wanted, the test packages, the CUTLASS
# headers (found without importing the package, whose Python side needs cuda-python and more).
ready() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$JAX_VERSION" "$PLUGIN" <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util, sys
jax_version, plugin = sys.argv[1], sys.argv[2]
assert md.version("jax") == jax_version and md.version("jaxlib") == jax_version
assert not plugin or md.version(plugin) == jax_version
for module in ("pytest", "xdist", "flatbuffers", "numpy", "cutlass_library"):
    assert importlib.util.find_spec(module) is not None, module
PY
}

if ! ready; then
  PIP_FLAGS=(-q)
  if [ -n "${FLASHJAX_WHEELHOUSE:-}" ]; then
    PIP_FLAGS+=(--no-index --find-links "$FLASHJAX_WHEELHOUSE")
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    PY=$(find_python) || { echo "flashjax: needs Python >= 3.12 (jax $JAX_VERSION requires it); none found" >&2; exit 1; }
    VENV_FLAGS=()
    [ "${FLASHJAX_SYSTEM_SITE_PACKAGES:-0}" = 1 ] && VENV_FLAGS+=(--system-site-packages)
    echo "flashjax: creating $VENV with $PY ${VENV_FLAGS[*]:-}"
    "$PY" -m venv "${VENV_FLAGS[@]}" "$VENV"
    [ -n "${FLASHJAX_WHEELHOUSE:-}" ] || "$VENV/bin/python" -m pip install -q --upgrade pip
  fi
  echo "flashjax: installing ${PACKAGES[*]} $CUTLASS into $VENV"
  "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "${PACKAGES[@]}"
  # The build reads CUTLASS's headers from this package and nothing else of it, so its Python dependencies
  # (cuda-python, scipy, networkx, ...) are not installed.
  "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-deps "$CUTLASS"
  ready || { echo "flashjax: $VENV is still missing packages after installing" >&2; exit 1; }
fi

# CMake and Ninja from the system when they are recent enough, else from PyPI into the venv.
cmake_ok() { command -v cmake >/dev/null && cmake --version | awk 'NR==1 { split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 24)) }'; }
if { ! cmake_ok && [ ! -x "$VENV/bin/cmake" ]; } || { ! command -v ninja >/dev/null && [ ! -x "$VENV/bin/ninja" ]; }; then
  "$VENV/bin/python" -m pip install -q ${FLASHJAX_WHEELHOUSE:+--no-index --find-links "$FLASHJAX_WHEELHOUSE"} \
    "cmake>=3.26" ninja
fi

if [ -n "$PLUGIN" ] && [ ! -f "$VENV/.flashjax-gpu-checked" ]; then
  if "$VENV/bin/python" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' 2>/dev/null; then
    touch "$VENV/.flashjax-gpu-checked"
  else
    echo "flashjax: warning: $VENV has $PLUGIN but JAX does not see the GPU (driver too old for CUDA" \
         "$FLASHJAX_CUDA_MAJOR?); \`$VENV/bin/python -m flashjax\` says more" >&2
  fi
fi

#!/usr/bin/env bash
# Creates (or reuses) .venv with Python >= 3.12 and the pinned build/test dependencies. Idempotent.
# jax 0.11.2 is pinned because its FFI headers are the ones the library is built against (and what the H200
# machine runs); newer jax accepts handlers built against older headers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLASHJAX_VENV:-.venv}
PINS=(jax==0.11.2 jaxlib==0.11.2 nvidia-cutlass==4.2.0.0 numpy pytest pytest-xdist scikit-build-core flatbuffers
      "cmake>=3.26" ninja matplotlib)

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

if [ ! -x "$VENV/bin/python" ] ||
   ! "$VENV/bin/python" -c 'import jax, cutlass_library, pytest, flatbuffers' 2>/dev/null; then
  PY=$(find_python) || { echo "flashjax: needs Python >= 3.12 (jax 0.11 requires it); none found" >&2; exit 1; }
  echo "flashjax: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${PINS[@]}"
fi

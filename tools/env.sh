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
#   FLASHJAX_PYTHON=python3.12       the interpreter to make the venv with (default: the first Python >= 3.12 found;
#                                    python3 with FLASHJAX_SYSTEM_SITE_PACKAGES)
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
  12|13) PLUGIN="jax-cuda$FLASHJAX_CUDA_MAJOR-plugin" ;;
  none) PLUGIN="" ;;
  *) echo "flashjax: FLASHJAX_CUDA_MAJOR must be 12, 13 or none, got '$FLASHJAX_CUDA_MAJOR'" >&2; exit 1 ;;
esac

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

# What the venv lacks, one pip requirement a line (nothing when it is complete): the pinned jax, the plugin when
# one is wanted, the test packages, the CUTLASS headers (found without importing the package, whose Python side
# needs cuda-python and more).
missing() {
  "$VENV/bin/python" - "$JAX_VERSION" "$FLASHJAX_CUDA_MAJOR" "$CUTLASS" <<'PY'
import importlib.metadata as md, importlib.util, sys
jax_version, cuda_major, cutlass = sys.argv[1:]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
if version("jax") != jax_version or version("jaxlib") != jax_version:
    print("jax==" + jax_version); print("jaxlib==" + jax_version)
if cuda_major != "none" and version(f"jax-cuda{cuda_major}-plugin") != jax_version:
    print(f"jax[cuda{cuda_major}]=={jax_version}")
for module, requirement in (("pytest", "pytest"), ("xdist", "pytest-xdist"), ("flatbuffers", "flatbuffers"),
                            ("numpy", "numpy"), ("cutlass_library", cutlass)):
    if importlib.util.find_spec(module) is None:
        print(requirement)
PY
}

if [ ! -x "$VENV/bin/python" ]; then
  if [ -n "${FLASHJAX_PYTHON:-}" ]; then PY=$FLASHJAX_PYTHON
  elif [ "${FLASHJAX_SYSTEM_SITE_PACKAGES:-0}" = 1 ]; then PY=$(command -v python3)  # the Python that has the packages
  else PY=$(find_python) || { echo "flashjax: needs Python >= 3.12 (jax $JAX_VERSION requires it); none found" >&2; exit 1; }
  fi
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' ||
    { echo "flashjax: needs Python >= 3.12 (jax $JAX_VERSION requires it); $PY is $("$PY" -V 2>&1)" >&2; exit 1; }
  VENV_FLAGS=()
  [ "${FLASHJAX_SYSTEM_SITE_PACKAGES:-0}" = 1 ] && VENV_FLAGS+=(--system-site-packages)
  echo "flashjax: creating $VENV with $PY ${VENV_FLAGS[*]:-}"
  "$PY" -m venv "${VENV_FLAGS[@]}" "$VENV"
  if [ "${FLASHJAX_SYSTEM_SITE_PACKAGES:-0}" = 1 ]; then
    # A venv sees its base installation's packages, not those of a venv it was made from: where python3 is itself
    # in a venv (conda, a container's /opt/.../.venv), its site-packages join through a .pth file.
    "$PY" -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/flashjax-parent.pth"
  fi
  [ -n "${FLASHJAX_WHEELHOUSE:-}" ] || "$VENV/bin/python" -m pip install -q --upgrade pip
fi
NEEDED=$(missing)
if [ -n "$NEEDED" ]; then
  PIP_FLAGS=(-q)
  [ -n "${FLASHJAX_WHEELHOUSE:-}" ] && PIP_FLAGS+=(--no-index --find-links "$FLASHJAX_WHEELHOUSE")
  echo "flashjax: installing into $VENV:" $NEEDED
  # The build reads CUTLASS's headers from its package and nothing else of it, so that one goes in without its
  # Python dependencies (cuda-python, scipy, networkx, ...).
  OTHERS=$(grep -v "^nvidia-cutlass" <<<"$NEEDED" || true)
  [ -z "$OTHERS" ] || "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" $OTHERS
  ! grep -q "^nvidia-cutlass" <<<"$NEEDED" || "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-deps "$CUTLASS"
  NEEDED=$(missing)
  [ -z "$NEEDED" ] || { echo "flashjax: $VENV still lacks:" $NEEDED >&2; exit 1; }
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

#!/usr/bin/env bash
# Builds the release wheel for the CUDA toolkit it finds: flashjax-cu13 next to jax[cuda13] with nvcc 13,
# flashjax-cu12 next to jax[cuda12] with nvcc 12 (CUDACXX picks the toolkit). Every kernel, the release
# architectures (CMakeLists.txt's "release"), into dist/ or $1.
#   1. stage the tree (tracked and untracked files that git does not ignore; all of it outside a git checkout) with the package named after the
#      toolkit's major: pyproject.toml is flashjax-cu13's, and CMake refuses a name that does not match nvcc;
#   2. pip wheel with scikit-build-core, without build isolation, from the venv's packages (so it works offline);
#   3. auditwheel reads the glibc symbol versions and libraries the library needs: the wheel gets the manylinux tag
#      that this build satisfies, and fails if it needs any library beyond the manylinux policy's (libc, libm, ...).
#   FLASHJAX_CUDA_ARCHS, FLASHJAX_KERNEL_SET   as for tools/build.sh (default here: release, full)
#   FLASHJAX_MANYLINUX_LINK=OFF                link against this machine's glibc instead of 2.28's (tag from it)
#   FLASHJAX_WHEEL_BUILD_DIR=DIR              keep the CMake build there (incremental rebuilds) instead of a temporary one
#   FLASHJAX_WHEELHOUSE=DIR                   offline: where scikit-build-core and auditwheel come from, if missing
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIST=$(realpath -m "${1:-dist}")
tools/env.sh
VENV=$(realpath "${FLASHJAX_VENV:-.venv}")
PIP_FLAGS=(-q ${FLASHJAX_WHEELHOUSE:+--no-index --find-links "$FLASHJAX_WHEELHOUSE"})
"$VENV/bin/python" -c 'import scikit_build_core, auditwheel, wheel' 2>/dev/null ||
  "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "scikit-build-core>=0.10" auditwheel wheel
MAJOR=$(tools/gpu.sh cuda-major)
[ -n "$MAJOR" ] || { echo "flashjax: no CUDA toolkit found (nvcc on PATH or CUDACXX)" >&2; exit 1; }
NAME=flashjax-cu$MAJOR

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$STAGE"
else  # a source archive (no .git): everything but what builds, venvs and runs leave behind
  tar --exclude=./build --exclude='./.venv*' --exclude=./.devcarry --exclude='*.so' --exclude=./bench/out \
    --exclude='__pycache__' -cf - . | tar -xf - -C "$STAGE"
fi
sed -i -e "s/^name = \"flashjax-cu13\"/name = \"$NAME\"/" -e "s/jax\[cuda13\]/jax[cuda$MAJOR]/" "$STAGE/pyproject.toml"
grep -q "^name = \"$NAME\"" "$STAGE/pyproject.toml" || { echo "flashjax: could not name the package $NAME" >&2; exit 1; }

export FLASHJAX_CUDA_ARCHS=${FLASHJAX_CUDA_ARCHS:-release} FLASHJAX_KERNEL_SET=${FLASHJAX_KERNEL_SET:-full}
# Linked against glibc 2.28's ABI (cmake/manylinux_link.cmake), so that the wheel installs on RHEL 8 and newer; the
# link directory is made once into build/glibc228 (ziglang and deb.debian.org) or given by FLASHJAX_GLIBC228_DIR.
export FLASHJAX_MANYLINUX_LINK=${FLASHJAX_MANYLINUX_LINK:-ON}
export FLASHJAX_GLIBC228_DIR=$(realpath -m "${FLASHJAX_GLIBC228_DIR:-$ROOT/build/glibc228}")
if [ "$FLASHJAX_MANYLINUX_LINK" = ON ] && [ ! -f "$FLASHJAX_GLIBC228_DIR/libc.so.6" ]; then
  "$VENV/bin/python" -c 'import ziglang' 2>/dev/null || "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" ziglang==0.17.1
  ZIG_PYTHON="$VENV/bin/python" tools/make_glibc228_libdir.sh "$FLASHJAX_GLIBC228_DIR"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${FLASHJAX_BUILD_JOBS:-$(nproc)}
BUILD_FLAGS=()
[ -n "${FLASHJAX_WHEEL_BUILD_DIR:-}" ] && BUILD_FLAGS+=(-C "build-dir=$(realpath -m "$FLASHJAX_WHEEL_BUILD_DIR")")
echo "flashjax: building $NAME (archs: $FLASHJAX_CUDA_ARCHS, kernels: $FLASHJAX_KERNEL_SET)"
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pip wheel --no-build-isolation --no-deps -q "${BUILD_FLAGS[@]}" \
  -w "$STAGE/raw" "$STAGE"
RAW=$(ls "$STAGE"/raw/*.whl)

# The manylinux tag this build satisfies, as auditwheel reads it off the library's glibc symbol versions.
SHOW=$("$VENV/bin/python" -m auditwheel show "$RAW")
PLATFORM=$(sed -n 's/.*consistent with the following platform tag: "\([^"]*\)".*/\1/p' <<<"${SHOW//$'\n'/ }")
[[ $PLATFORM =~ ^manylinux_2_([0-9]+)_x86_64$ ]] ||
  { echo "$SHOW" >&2; echo "flashjax: the library is not manylinux-compatible" >&2; exit 1; }
# The glibc 2.28 link promises 2_28 (the policy we build for) even where this build happens to need less.
[ "$FLASHJAX_MANYLINUX_LINK" != ON ] || (( BASH_REMATCH[1] > 28 )) || PLATFORM=manylinux_2_28_x86_64
mkdir -p "$DIST"
"$VENV/bin/python" -m wheel tags --remove --platform-tag "$PLATFORM" "$RAW" >/dev/null
WHEEL=$(ls "$STAGE"/raw/*.whl)
mv "$WHEEL" "$DIST/"
WHEEL=$DIST/$(basename "$WHEEL")
echo "flashjax: $WHEEL ($(du -m "$WHEEL" | cut -f1) MB)"
echo "$SHOW" | sed 's/^/  auditwheel: /' | head -n 20

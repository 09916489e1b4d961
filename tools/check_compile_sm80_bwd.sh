#!/usr/bin/env bash
# Compile-checks the sm80-family backward for sm_80 and sm_90a and prints ptxas register / spill / smem usage.
# Usage: tools/check_compile_sm80_bwd.sh [bf16|fp16] [head_dim ...]     (default: bf16 128)
# Writes an instantiation TU identical in shape to the generated ones into a temporary directory; one nvcc at a
# time (the build machine is small).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-/usr/local/cuda/bin/nvcc}"
cutlass_include="${CUTLASS_INCLUDE:-$repo/.venv/lib/python3.12/site-packages/cutlass_library/source/include}"

dtype="${1:-bf16}"
shift || true
head_dims=("$@")
[[ ${#head_dims[@]} -gt 0 ]] || head_dims=(128)
case "$dtype" in
  bf16) element="cutlass::bfloat16_t" ;;
  fp16) element="cutlass::half_t" ;;
  *) echo "dtype must be bf16 or fp16, got '$dtype'" >&2; exit 2 ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for hdim in "${head_dims[@]}"; do
  tu="$work/sm80_bwd_${dtype}_hdim${hdim}.cu"
  cat >"$tu" <<TU
#include "kernels/sm80/bwd_launch.cuh"
template cudaError_t flashjax::sm80::run_bwd<${element}, ${hdim}>(const flashjax::BwdParams&, cudaStream_t);
TU
  for arch in sm_80 sm_90a; do
    echo "== ${dtype} hdim ${hdim} ${arch}"
    start=$(date +%s)
    "$nvcc" -std=c++17 --expt-relaxed-constexpr -O3 -arch="$arch" -Xptxas -v \
      -I"$repo/csrc" -I"$repo/csrc/include" -I"$cutlass_include" \
      -c "$tu" -o "$work/out.o" 2>&1 |
      grep -E "error|warning|Compiling entry|registers|spill" | grep -v "^ptxas info    : Function properties" || true
    [[ -s "$work/out.o" ]] || { echo "compile failed: ${dtype} hdim ${hdim} ${arch}" >&2; exit 1; }
    rm -f "$work/out.o"
    echo "   compile time: $(($(date +%s) - start)) s"
  done
done

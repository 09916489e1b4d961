#!/usr/bin/env bash
# Compile-checks one instantiation of the sm80-family forward kernel for sm_80 and sm_90a, printing register and
# spill counts (-Xptxas -v) of its two kernels (softcap off / on) and the wall time per arch.
# Usage: tools/check_compile_sm80_fwd.sh [bf16|fp16] [head_dim]
set -euo pipefail

dtype="${1:-bf16}"
head_dim="${2:-128}"
case "$dtype" in
  bf16) element="cutlass::bfloat16_t" ;;
  fp16) element="cutlass::half_t" ;;
  *) echo "dtype must be bf16 or fp16, got '$dtype'" >&2; exit 2 ;;
esac

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-/usr/local/cuda/bin/nvcc}"
cutlass_include="${CUTLASS_INCLUDE:-$repo/.venv/lib/python3.12/site-packages/cutlass_library/source/include}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Same shape as the instantiation files tools/gen_kernels.py generates.
cat >"$work/fwd_instance.cu" <<CU
#include "kernels/sm80/fwd_launch.cuh"
template cudaError_t flashjax::sm80::run_fwd<$element, $head_dim>(const flashjax::FwdParams&, cudaStream_t);
CU

for arch in sm_80 sm_90a; do
  echo "== $dtype hdim $head_dim, $arch"
  start=$(date +%s)
  "$nvcc" -std=c++17 --expt-relaxed-constexpr -O3 -arch="$arch" -Xptxas -v \
    -I"$repo/csrc" -I"$repo/csrc/include" -I"$cutlass_include" \
    -c "$work/fwd_instance.cu" -o "$work/fwd_instance_$arch.o" 2>&1 |
    grep -E "error|warning|Compiling entry|registers|spill|bytes stack" |
    sed -E "s/.*Compiling entry function .*fwd_kernel_sm80.*Lb([01])E.*/-- kernel softcap=\1/" || true
  test -s "$work/fwd_instance_$arch.o" || { echo "compile failed for $arch" >&2; exit 1; }
  echo "compile time: $(( $(date +%s) - start )) s"
done

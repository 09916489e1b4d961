#!/usr/bin/env bash
# Compile-checks one instantiation of the sm90 (Hopper) forward kernel for sm_90a, printing register and spill
# counts (-Xptxas -v), the wall time, and the dynamic shared memory per CTA (which ptxas does not see: a small host
# program prints sizeof the kernel's SharedStorage; no GPU needed).
# Usage: tools/check_compile_sm90_fwd.sh [bf16|fp16] [head_dim]
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
#include "kernels/sm90/fwd_launch.cuh"
template cudaError_t flashjax::sm90::run_fwd<$element, $head_dim>(const flashjax::FwdParams&, cudaStream_t);
CU

echo "== $dtype hdim $head_dim, sm_90a"
start=$(date +%s)
status=0
"$nvcc" -std=c++17 --expt-relaxed-constexpr -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
  -I"$repo/csrc" -I"$repo/csrc/include" -isystem "$cutlass_include" \
  -c "$work/fwd_instance.cu" -o "$work/fwd_instance.o" >"$work/log" 2>&1 || status=$?
grep -E "error|warning|registers|spill|bytes stack|smem" "$work/log" || true
if [ "$status" -ne 0 ] || [ ! -s "$work/fwd_instance.o" ]; then
  echo "compile failed:" >&2
  head -60 "$work/log" >&2
  exit 1
fi
echo "compile time: $(( $(date +%s) - start )) s"

cat >"$work/smem_size.cu" <<CU
#include <cstdio>
#include "kernels/sm90/fwd_kernel.cuh"
template <bool kBanded>
void print_config() {
  using namespace flashjax::sm90;
  constexpr FwdTileSizes kTile = fwd_tile_sizes($head_dim, kBanded);
  using Kernel = FwdKernelSm90<$element, $head_dim, kTile.block_n>;
  std::printf("%s tile %d x %d: dynamic smem %d bytes (limit 232448)\\n", kBanded ? "banded  " : "unbanded",
              kTile.block_m, kTile.block_n, Kernel::kSmemBytes);
}
int main() {
  print_config<false>();
  print_config<true>();
}
CU
"$nvcc" -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
  -I"$repo/csrc" -I"$repo/csrc/include" -isystem "$cutlass_include" "$work/smem_size.cu" -o "$work/smem_size"
"$work/smem_size"

#!/usr/bin/env bash
# Compile-checks kernel instantiations without a GPU and prints ptxas' register / spill / stack report per kernel
# and the compile time per arch. The translation unit is the generated one (tools/gen_kernels.py --print).
# Portable families compile for sm_80 and sm_90a (CHECK_ARCHS overrides); arch-specific ones (sm90) for sm_90a only,
# and for those a small host program also prints the dynamic shared memory per tile configuration (ptxas does not
# see it).
# Usage: tools/check_compile.sh FAMILY DIRECTION [bf16|fp16] [head_dim[:smem_kb] ...]
#   e.g. tools/check_compile.sh sm80 bwd bf16 64 128 128:99   (128:99: the sm80 row whose tiles fit 99 KB; a plain
#   head dim is the family's first budget, gen_kernels.py's SMEM_BUDGETS); tools/check_compile.sh sm80 tangent bf16
#   64 256 256:99 for the tangent kernel (jax.jvp); tools/check_compile.sh sm90 tangent bf16 64 128 256 for the
#   Hopper one
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
family="${1:?family (sm80, sm90)}"
direction="${2:?direction (fwd, bwd, tangent)}"
dtype="${3:-bf16}"
shift $(( $# < 3 ? $# : 3 ))
head_dims=("$@")
[[ ${#head_dims[@]} -gt 0 ]] || head_dims=(128)
case "$dtype" in
  bf16) element="cutlass::bfloat16_t" ;;
  fp16) element="cutlass::half_t" ;;
  *) echo "dtype must be bf16 or fp16, got '$dtype'" >&2; exit 2 ;;
esac
case "$family" in
  sm90) archs=(sm_90a) ;;
  *) archs=(sm_80 sm_90a) ;;
esac
# CHECK_ARCHS="sm_80 sm_120" overrides the list (e.g. the release build's sm_100 / sm_120 for the portable family).
[[ -n ${CHECK_ARCHS:-} ]] && read -r -a archs <<<"$CHECK_ARCHS"
nvcc="${NVCC:-/usr/local/cuda/bin/nvcc}"
python="${PYTHON:-$repo/.venv/bin/python}"
cutlass_include="${CUTLASS_INCLUDE:-$("$python" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}"
flags=(-std=c++17 --expt-relaxed-constexpr -O3 -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
       -I"$repo/csrc" -I"$repo/csrc/include" -isystem "$cutlass_include")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for row in "${head_dims[@]}"; do
  hdim=${row%%:*}
  budget=()
  [[ $row == *:* ]] && budget=("${row#*:}")
  "$python" "$repo/tools/gen_kernels.py" --print "$family" "$direction" "$dtype" "$hdim" "${budget[@]}" \
    >"$work/instance.cu"
  for arch in "${archs[@]}"; do
    echo "== $family $direction $dtype hdim $hdim${budget:+ (${budget} KB row)}, $arch"
    start=$(date +%s)
    status=0
    "$nvcc" "${flags[@]}" -gencode="arch=compute_${arch#sm_},code=$arch" -Xptxas -v \
      -c "$work/instance.cu" -o "$work/instance.o" >"$work/log" 2>&1 || status=$?
    grep -E "error|warning|Compiling entry|registers|spill|bytes stack" "$work/log" |
      grep -v "Function properties" || true
    if [ "$status" -ne 0 ] || [ ! -s "$work/instance.o" ]; then
      echo "compile failed:" >&2
      head -60 "$work/log" >&2
      exit 1
    fi
    echo "   compile time: $(( $(date +%s) - start )) s"
  done
  if [ "$family" = sm90 ] && [ "$direction" = fwd ]; then
    cat >"$work/smem_size.cu" <<CU
#include <cstdio>
#include "kernels/sm90/fwd_launch.cuh"
template <flashjax::sm90::FwdKeyLoad kLoad>
void print_config(const char* name) {
  using namespace flashjax::sm90;
  constexpr FwdTileSizes kTile = fwd_tile_sizes($hdim, kLoad);
  using Kernel = FwdKernelSm90<$element, $hdim, kTile.block_m, kTile.block_n, /*kSoftcap=*/false, /*kPackGqa=*/false>;
  std::printf("   %-15s tile %d x %d: dynamic smem %d bytes (limit 232448)\\n", name, kTile.block_m, kTile.block_n,
              Kernel::kSmemBytes);
}
int main() {
  using flashjax::sm90::FwdKeyLoad;
  print_config<FwdKeyLoad::kFew>("few keys");
  print_config<FwdKeyLoad::kMany>("many keys");
  print_config<FwdKeyLoad::kFewShortBand>("short band");
  std::printf("   dispatch figure (fwd_smem_bytes): %d bytes\\n", flashjax::sm90::fwd_smem_bytes<$element, $hdim>());
}
CU
    "$nvcc" "${flags[@]}" -gencode=arch=compute_90a,code=sm_90a "$work/smem_size.cu" -o "$work/smem_size"
    "$work/smem_size"
  fi
  if [ "$family" = sm90 ] && [ "$direction" = tangent ]; then
    cat >"$work/smem_size.cu" <<CU
#include <cstdio>
#include "kernels/sm90/tangent_launch.cuh"
int main() {
  constexpr flashjax::sm90::TangentTileSizes kTile = flashjax::sm90::tangent_tile_sizes($hdim);
  std::printf("   tile %d x %d, %d (K, tK) + %d (V, tV) stages: dynamic smem %d bytes (limit 232448)\n", kTile.block_m,
              kTile.block_n, kTile.stages_k, kTile.stages_v, flashjax::sm90::tangent_smem_bytes<$element, $hdim>());
}
CU
    "$nvcc" "${flags[@]}" -gencode=arch=compute_90a,code=sm_90a "$work/smem_size.cu" -o "$work/smem_size"
    "$work/smem_size"
  fi
done

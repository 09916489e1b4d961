// Small numeric and register-fragment helpers of the sm80 backward (self-contained, so that this family builds on
// its own while kernels/common/ evolves; the forward has equivalents in kernels/common/).
//
// A thread's mma.sync m16n8 accumulator fragment (TiledMMA::partition_C) has layout ((2, 2), MMA_M, MMA_N): the
// inner (2, 2) is (2 adjacent columns) x (rows r and r + 8) of one 16x8 atom tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashjax::sm80 {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// 2^x on the special-function unit (ex2.approx, ~2 ulp, far below the bf16/fp16 rounding of P), flushing
// subnormals: P values under 2^-126 are invisible after rounding to Element anyway. exp2(-inf) = +0, which the
// masking and the empty-row handling rely on.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ((2, 2), MMA_M, MMA_N) -> ((2, MMA_M), (2, MMA_N)): index a fragment by (row, col). Flat column indices 2k and
// 2k + 1 are adjacent columns of one row.
template <typename Tensor>
__host__ __device__ auto fragment_rowcol_view(Tensor&& acc) {
  using namespace cute;
  using Layout = decltype(acc.layout());
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4, "expected an m16n8 accumulator fragment");
  auto split = logical_divide(acc.layout(), Shape<_2>{});  // ((2, 2), MMA_M, MMA_N), mode 0 = (col pair, row half)
  return make_tensor(acc.data(), make_layout(make_layout(get<0, 1>(split), get<1>(split)),
                                             make_layout(get<0, 0>(split), get<2>(split))));
}

// Converts a compact register fragment to To with the packed converters (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
template <typename To, typename Engine, typename Layout>
__device__ __forceinline__ auto convert_fragment(const cute::Tensor<Engine, Layout>& src) {
  using From = typename Engine::value_type;
  constexpr int kNumel = decltype(cute::size(src))::value;
  auto dst = cute::make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, kNumel> convert;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, kNumel>*>(src.data()));
  return dst;
}

}  // namespace flashjax::sm80

// Views of mma.sync m16n8k16 register fragments (SM80_16x8x16_F32*_TN), shared by the sm80 forward and backward.
//
// A thread's accumulator fragment from TiledMMA::partition_C has layout ((2, 2), MMA_M, MMA_N): the inner (2, 2)
// is (2 adjacent columns) x (rows r and r + 8) of one 16x8 atom tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashjax::common {

// ((2, 2), MMA_M, MMA_N) -> ((2, MMA_M), (2, MMA_N)): index a fragment by (row, col) for row-wise softmax and masks.
template <typename Layout>
__host__ __device__ constexpr auto acc_rowcol_layout(Layout acc) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4, "expected an m16n8 accumulator fragment");
  auto split = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N) with mode 0 = (col pair, row half)
  return make_layout(make_layout(get<0, 1>(split), get<1>(split)), make_layout(get<0, 0>(split), get<2>(split)));
}

template <typename Tensor>
__host__ __device__ auto acc_rowcol_view(Tensor&& acc) {
  return cute::make_tensor(acc.data(), acc_rowcol_layout(acc.layout()));
}

// ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2): reuse an m16n8 accumulator (P = softmax(S)) as the
// A operand of the next m16n8k16 MMA without moving data, since two adjacent n8 tiles form one k16 A tile.
template <typename Layout>
__host__ __device__ constexpr auto acc_as_a_operand_layout(Layout acc) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && size<0>(Layout{}) == 4, "expected an m16n8 accumulator fragment");
  static_assert(size<2>(Layout{}) % 2 == 0, "MMA_N must be even to form k16 tiles");
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2, 2), MMA_M, (2, MMA_N / 2))
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

// Converts a register fragment to To with the packed converters (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
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

}  // namespace flashjax::common

// wgmma helpers shared by the sm90 kernels: issuing a warpgroup GEMM with the fences it needs, and views of the
// wgmma accumulator fragment (row/col for softmax and masks, A operand for an RS GEMM).
//
// A 64 x N wgmma accumulator, as TiledMma::partition_C gives it to one thread, has layout ((2, 2, N / 8), 1, 1):
// (2 adjacent columns) x (rows r and r + 8) x (the N / 8 column blocks). Warp w of the warpgroup owns rows
// 16w .. 16w + 15 and lane l holds rows 16w + l / 4 (+ 8), so, as with mma.sync, a row is spread over the 4 lanes
// of a quad (common::quad_allreduce).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flashjax::common {

// Issues C (+)= A * B on the calling warpgroup as one wgmma batch. kZeroInit: C is overwritten (the first K slice
// does not accumulate), so C needs no clearing. kWaitGroups >= 0 waits until at most that many batches are in
// flight; -1 returns at once and the caller waits later with cute::warpgroup_wait. The operand fences stop the
// compiler from moving reads or writes of the register operands (C, and A for an RS GEMM) across the asynchronous
// wgmma: until the matching wait, those registers belong to the tensor core.
template <bool kZeroInit, int kWaitGroups, typename TiledMma, typename TensorA, typename TensorB, typename TensorC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& tiled_mma, TensorA& a, const TensorB& b, TensorC& c) {
  using namespace cute;
  // SS atoms take A as shared-memory descriptors, RS atoms as registers.
  constexpr bool kAInRegisters = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kAInRegisters) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(tiled_mma, a(_, _, k), b(_, _, k), c);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWaitGroups >= 0) warpgroup_wait<kWaitGroups>();
  warpgroup_fence_operand(c);
  if constexpr (kAInRegisters) warpgroup_fence_operand(a);
}

// ((2, 2, N / 8), MMA_M, MMA_N) -> ((2, MMA_M), (2, N / 8, MMA_N)): (row, col) indexing of a wgmma accumulator.
template <typename Layout>
__host__ __device__ constexpr auto wgmma_acc_rowcol_layout(Layout acc) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 3, "expected a wgmma accumulator fragment");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <typename Tensor>
__host__ __device__ auto wgmma_acc_rowcol_view(Tensor&& acc) {
  return cute::make_tensor(acc.data(), wgmma_acc_rowcol_layout(acc.layout()));
}

// ((2, 2, N / 8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, N / 16 * MMA_N): the accumulator of S = Q K^T reused as the
// A operand of a 16-bit RS wgmma (O += P V) with no data movement. An A k16 slice holds (2 adjacent k) x (rows r,
// r + 8) x (k 0-7, 8-15) per thread, i.e. exactly two adjacent n8 column blocks of the accumulator.
template <typename Layout>
__host__ __device__ constexpr auto wgmma_acc_as_a_layout(Layout acc) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 3, "expected a wgmma accumulator fragment");
  static_assert(size<0, 2>(Layout{}) % 2 == 0, "N / 8 must be even to form k16 slices");
  auto col_blocks = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N / 16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(col_blocks)), get<1>(acc),
                     coalesce(make_layout(get<0, 1>(col_blocks), get<2>(acc))));
}

// dst = To(src) elementwise with the packed converters (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32). Both fragments are
// register-resident with the same number of elements; only the order of their storage matters, which the
// layout helpers above keep identical.
template <typename EngineSrc, typename LayoutSrc, typename EngineDst, typename LayoutDst>
__device__ __forceinline__ void convert_fragment_into(const cute::Tensor<EngineSrc, LayoutSrc>& src,
                                                      cute::Tensor<EngineDst, LayoutDst>& dst) {
  using From = typename EngineSrc::value_type;
  using To = typename EngineDst::value_type;
  constexpr int kNumel = decltype(cute::size(src))::value;
  static_assert(kNumel == decltype(cute::size(dst))::value);
  cutlass::NumericArrayConverter<To, From, kNumel> convert;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, kNumel>*>(src.data()));
}

}  // namespace flashjax::common

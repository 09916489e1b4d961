// CTA-wide GEMM steps of the sm80 family (forward and backward): acc += A * B with the operands in shared memory
// (ldmatrix through tiled copies) or A already in registers.
#pragma once

#include <cute/tensor.hpp>

namespace flashjax::sm80 {

// rA / rB are the thread's register fragments (MMA, MMA_M|N, MMA_K) from partition_fragment_A/B; sA / sB the
// matching shared-memory partitions (ThrCopy::partition_S) of the ldmatrix tiled copies copy_a / copy_b.
// k-slice i + 1 is loaded while slice i multiplies, so each ldmatrix has one MMA slice of latency to hide behind.
template <typename TiledMma, typename Acc, typename FragA, typename FragB, typename SmemA, typename SmemB,
          typename CopyA, typename CopyB>
__device__ __forceinline__ void gemm_smem_smem(const TiledMma& tiled_mma, Acc& acc, FragA& rA, FragB& rB,
                                               const SmemA& sA, const SmemB& sB, const CopyA& copy_a,
                                               const CopyB& copy_b) {
  using namespace cute;
  auto rA_view = make_tensor(rA.data(), CopyA::retile(rA.layout()));
  auto rB_view = make_tensor(rB.data(), CopyB::retile(rB.layout()));
  static_assert(decltype(size<2>(rA))::value == decltype(size<2>(rB))::value, "A and B must share the K extent");
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A * B with A already in registers (e.g. P of the forward) and B streamed from shared memory one k-slice
// ahead.
template <typename TiledMma, typename Acc, typename FragA, typename FragB, typename SmemB, typename CopyB>
__device__ __forceinline__ void gemm_reg_smem(const TiledMma& tiled_mma, Acc& acc, const FragA& rA, FragB& rB,
                                              const SmemB& sB, const CopyB& copy_b) {
  using namespace cute;
  auto rB_view = make_tensor(rB.data(), CopyB::retile(rB.layout()));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    gemm(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

}  // namespace flashjax::sm80

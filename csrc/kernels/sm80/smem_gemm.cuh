// CTA-wide GEMM steps of the sm80 family (forward and backward): acc += A * B with the operands in shared memory
// (ldmatrix through tiled copies) or one of them already in registers.
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

// A product and its tangent in one pass over K: acc += A B and acc_t += tA B + A tB (the tangent kernel's S = Q K^T
// and tS = tQ K^T + Q tK^T). Each k-slice of the four operands is loaded once and feeds three MMAs, so that A and B
// are read from shared memory once, not twice; the next slice is loaded while this one multiplies, as above.
template <typename TiledMma, typename Acc, typename FragA, typename FragB, typename SmemA, typename SmemB,
          typename CopyA, typename CopyB>
__device__ __forceinline__ void gemm_smem_smem_with_tangent(const TiledMma& tiled_mma, Acc& acc, Acc& acc_t,
                                                            FragA& rA, FragA& rtA, FragB& rB, FragB& rtB,
                                                            const SmemA& sA, const SmemA& stA, const SmemB& sB,
                                                            const SmemB& stB, const CopyA& copy_a,
                                                            const CopyB& copy_b) {
  using namespace cute;
  auto rA_view = make_tensor(rA.data(), CopyA::retile(rA.layout()));
  auto rtA_view = make_tensor(rtA.data(), CopyA::retile(rtA.layout()));
  auto rB_view = make_tensor(rB.data(), CopyB::retile(rB.layout()));
  auto rtB_view = make_tensor(rtB.data(), CopyB::retile(rtB.layout()));
  static_assert(decltype(size<2>(rA))::value == decltype(size<2>(rB))::value, "A and B must share the K extent");
  auto load = [&](int k) {
    copy(copy_a, sA(_, _, k), rA_view(_, _, k));
    copy(copy_a, stA(_, _, k), rtA_view(_, _, k));
    copy(copy_b, sB(_, _, k), rB_view(_, _, k));
    copy(copy_b, stB(_, _, k), rtB_view(_, _, k));
  };
  load(0);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) load(k + 1);
    gemm(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
    gemm(tiled_mma, rtA(_, _, k), rB(_, _, k), acc_t);
    gemm(tiled_mma, rA(_, _, k), rtB(_, _, k), acc_t);
  }
}

// acc += A * B with one operand already in registers and the other, `streamed` (the same fragment as rA or rB),
// loaded from shared memory one k-slice ahead.
template <typename TiledMma, typename Acc, typename FragA, typename FragB, typename FragS, typename SmemS,
          typename CopyS>
__device__ __forceinline__ void gemm_one_streamed(const TiledMma& tiled_mma, Acc& acc, const FragA& rA, const FragB& rB,
                                                  FragS& streamed, const SmemS& s_streamed, const CopyS& copy_s) {
  using namespace cute;
  auto view = make_tensor(streamed.data(), CopyS::retile(streamed.layout()));
  copy(copy_s, s_streamed(_, _, 0), view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_s, s_streamed(_, _, k + 1), view(_, _, k + 1));
    gemm(tiled_mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// A already in registers (e.g. P of the forward), B streamed.
template <typename TiledMma, typename Acc, typename FragA, typename FragB, typename SmemB, typename CopyB>
__device__ __forceinline__ void gemm_reg_smem(const TiledMma& tiled_mma, Acc& acc, const FragA& rA, FragB& rB,
                                              const SmemB& sB, const CopyB& copy_b) {
  gemm_one_streamed(tiled_mma, acc, rA, rB, rB, sB, copy_b);
}

// B already in registers (the backward's V, when it lives there), A streamed.
template <typename TiledMma, typename Acc, typename FragA, typename FragB, typename SmemA, typename CopyA>
__device__ __forceinline__ void gemm_smem_reg(const TiledMma& tiled_mma, Acc& acc, FragA& rA, const FragB& rB,
                                              const SmemA& sA, const CopyA& copy_a) {
  gemm_one_streamed(tiled_mma, acc, rA, rB, rA, sA, copy_a);
}

}  // namespace flashjax::sm80

// Score processing and online softmax of the sm90 forward kernel, on one consumer warpgroup's 64 x kBlockN score
// fragment in (row, col) view (wgmma.cuh): each thread holds 2 rows, each row spread over a quad.
//
// Differs from the sm80 loop (common::OnlineSoftmax::update) in two ways. The O accumulator is rescaled in a
// separate step: with the intra-warpgroup overlap, softmax(S_j) runs while the wgmma O += P_{j-1} V_{j-1} is still
// writing O, so the correction factors are computed first and applied only after that wgmma has been waited on.
// And past a tile's first block, the common case skips the row max altogether (exponentiate_at_reference) or the
// rescale of O (the lazy update), whichever measured faster for the head dim (FwdMainloopSm90).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/online_softmax.cuh"
#include "kernels/common/softcap.cuh"

namespace flashjax::sm90 {

// Raw q.k accumulators -> values ordered like the true scores, with invisible keys at -inf. Softcap first: capping
// after masking would turn -inf into -c, a visible key. The band mask runs only on the blocks that need it
// (KvBlockRange's masked blocks, which the mainloop visits in a loop of their own). kSoftcap: the kernel was compiled
// for capped calls (FwdMainloopSm90); uncapped kernels carry none of its code.
template <bool kNeedsMask, bool kSoftcap, typename ScoresRC, typename CoordsRC, typename Mask>
__device__ __forceinline__ void transform_and_mask_scores(ScoresRC& scores_rc, const CoordsRC& coords_rc,
                                                          const common::ScoreTransform& transform, const Mask& mask,
                                                          int n_start) {
  if constexpr (kSoftcap) transform.apply_softcap(scores_rc);
  if constexpr (kNeedsMask) mask.apply(scores_rc, coords_rc, n_start);
}

// kLazyRescale: see kMaxGrowthLog2 below; without it every block moves the reference to the running max and O is
// always rescaled (update returns true).
template <int kRows, bool kLazyRescale = false>
struct FwdOnlineSoftmaxSm90 : common::OnlineSoftmax<kRows> {
  using Base = common::OnlineSoftmax<kRows>;
  using Base::row_sum;
  static constexpr int kNumRows = kRows;

  __device__ __forceinline__ explicit FwdOnlineSoftmaxSm90(float exp2_scale_) : Base(exp2_scale_) {}

  // Lazy rescale (FA4's rule): a row's reference max moves only when the block's max exceeds it by more than
  // kMaxGrowthLog2 in the log2 domain. Below that, exp2(s - reference) <= 256, harmless in the fp32 sums and in
  // 16-bit P, and the softmax is the same function of any reference (finalize's LSE included). Past the first
  // blocks a row's max rarely grows that much, so O's rescale (D / 2 multiplies per thread and block) is skipped
  // for the whole warp when none of its rows moved. Which kernels use it: FwdMainloopSm90::kLazyRescale.
  static constexpr float kMaxGrowthLog2 = 8.f;

  // Folds one block into the running row max / sum and replaces the scores by exp2(s - reference) in the log2
  // domain. correction[r] is what O must be multiplied by (rescale_o) to be relative to the new reference (1 where
  // it stayed); returns whether O needs that rescale (with kLazyRescale: whether any row of this warp moved its
  // reference). A row with no visible key yet keeps row_max = -inf and base 0, as in common::OnlineSoftmax.
  template <typename ScoresRC>
  __device__ __forceinline__ bool update(ScoresRC& scores, float (&correction)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(scores))::value == kRows);
    if constexpr (!kLazyRescale) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float base = Base::fold_row_max(scores, r, correction[r]);
        // Summed per thread; finalize() reduces over the quad once per tile instead of once per block.
        const float sum = Base::exponentiate_row(scores, r, base);
        row_sum[r] = row_sum[r] * correction[r] + sum;
      }
      return true;
    }
    bool moved_any = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float new_max = Base::running_row_max(scores, r);
      const float old_log2 = Base::row_max[r] * Base::exp2_scale;
      // old = -inf and new finite: +inf > threshold, moves; both -inf: NaN, stays (-inf, base 0).
      const bool moves = new_max * Base::exp2_scale - old_log2 > kMaxGrowthLog2;
      if (moves) Base::row_max[r] = new_max;
      const float base = Base::row_max[r] == -INFINITY ? 0.f : Base::row_max[r] * Base::exp2_scale;
      correction[r] = moves ? common::exp2_ftz(old_log2 - base) : 1.f;
      moved_any |= moves;
      const float sum = Base::exponentiate_row(scores, r, base);
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
    return __any_sync(0xffffffffu, moved_any);
  }

  // Fast path for a block after the first (FwdMainloopSm90::kExponentiateAtReference): P = exp2(s - reference)
  // against the reference the earlier blocks set, with no search for this block's row max, written straight into
  // the 16-bit fragment `p_rc` (the scores stay as they were). The max reduction (an FMNMX per score and the quad
  // shuffles), the corrections and O's rescale drop out: at D 128 that is ~130 of the ~420 instructions per thread
  // and block, worth +9-11% (docs/performance.md). The result is the same function as with the exact max as long as
  // no P is large enough to lose the fp32 sums' or 16-bit P's range, the lazy rule's bound (P <= 256 above). This
  // thread checks it on its row sums: sum <= 256 implies every term <= 256; a row with no visible key yet has
  // reference -inf, hence +inf arguments and an inf sum; a NaN score gives a NaN sum. Returns, uniformly over the
  // warp, whether every row of the warp passed; only then are the sums folded in. Otherwise nothing is folded in,
  // and the caller redoes the block with update() (from the intact scores) and rescale_o().
  static constexpr float kFastPathSumLimit = 256.f;

  template <typename ScoresRC, typename PRC>
  __device__ __forceinline__ bool exponentiate_at_reference(const ScoresRC& scores, PRC& p_rc) {
    using namespace cute;
    using Element = typename PRC::value_type;
    static_assert(decltype(size<0>(scores))::value == kRows);
    float sum[kRows];
    bool within = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float base = Base::row_max[r] * Base::exp2_scale;  // -inf for a row with no visible key yet
      sum[r] = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); c += 2) {
        cutlass::Array<float, 2> pair;
        pair[0] = common::exp2_ftz(fmaf(scores(r, c), Base::exp2_scale, -base));
        pair[1] = common::exp2_ftz(fmaf(scores(r, c + 1), Base::exp2_scale, -base));
        sum[r] += pair[0];
        sum[r] += pair[1];
        // Columns c, c + 1 are adjacent in the fragment's storage (common::wgmma_acc_rowcol_layout).
        *reinterpret_cast<cutlass::Array<Element, 2>*>(&p_rc(r, c)) =
            cutlass::NumericArrayConverter<Element, float, 2>{}(pair);
      }
      within &= sum[r] <= kFastPathSumLimit;
    }
    if (!__all_sync(0xffffffffu, within)) return false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) row_sum[r] += sum[r];
    return true;
  }

  template <typename AccORC>
  __device__ __forceinline__ static void rescale_o(AccORC& acc_o, const float (&correction)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= correction[r];
    }
  }
};

}  // namespace flashjax::sm90

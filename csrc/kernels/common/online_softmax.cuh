// Online (streaming) softmax over KV blocks, in registers, FlashAttention-2 style.
//
// Works on (row, col) views of one thread's fragments (see sm80/mma_fragment_layouts.cuh): each row of the score tile
// is spread over the 4 lanes of a quad, so row statistics are quad all-reductions.
//
// Invariants, per row, after each update:
//   row_max = max of the masked fragment values seen so far (-inf while every one was masked);
//   row_sum = this thread's share of sum_j exp2(x_j * exp2_scale - row_max * exp2_scale) (quad-reduced at the end);
//   acc_o   = sum_j exp2(...) * v_j, relative to the same row_max.
// (The sm90 forward's lazy variant, sm90/fwd_softmax.cuh, keeps a reference in place of row_max that trails the
// running max by at most 8 in the log2 domain; the same invariants hold with that reference.)
// A fully masked row keeps row_max = -inf: the exp2 base is then taken as 0 so that exp2(-inf - base) = 0 and no
// -inf - (-inf) = NaN is ever formed; such a row ends with row_sum = 0, acc_o = 0.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/fast_math.cuh"

namespace flashjax::common {

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float exp2_scale;  // maps fragment values to log2-domain logits (ScoreTransform::exp2_scale)

  __device__ __forceinline__ explicit OnlineSoftmax(float exp2_scale_) : exp2_scale(exp2_scale_) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Folds one block of scores into the running statistics: rescales acc_o by exp2(old_max - new_max) and replaces
  // scores by the unnormalized probabilities exp2(s - new_max) (log2 domain).
  template <typename ScoresRC, typename AccORC>
  __device__ __forceinline__ void update(ScoresRC& scores, AccORC& acc_o) {
    using namespace cute;
    static_assert(decltype(size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float correction;
      const float base = fold_row_max(scores, r, correction);
      row_sum[r] *= correction;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= correction;
      row_sum[r] += exponentiate_row(scores, r, base);
    }
  }

  // max(row_max[r], row r of the block), reduced over the quad that holds the row.
  template <typename ScoresRC>
  __device__ __forceinline__ float running_row_max(const ScoresRC& scores, int r) const {
    using namespace cute;
    float block_max = row_max[r];
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) block_max = fmaxf(block_max, scores(r, c));
    return quad_allreduce(block_max, MaxOp{});
  }

  // The two halves of one row's update, shared with kernels that rescale O elsewhere (sm90/fwd_softmax.cuh).
  // fold_row_max: folds row r of the block into row_max and returns the exp2 base (new max in the log2 domain, 0
  // for a row with no visible key so far, so that no -inf - (-inf) is formed); `correction` is what the row's O and
  // sum must be multiplied by to be relative to the new max (old max = -inf gives exp2(-inf) = 0: the first block
  // needs no special case).
  template <typename ScoresRC>
  __device__ __forceinline__ float fold_row_max(const ScoresRC& scores, int r, float& correction) {
    const float new_max = running_row_max(scores, r);
    const float base = new_max == -INFINITY ? 0.f : new_max * exp2_scale;
    correction = exp2_ftz(row_max[r] * exp2_scale - base);
    row_max[r] = new_max;
    return base;
  }

  // exponentiate_row: replaces row r by exp2(s * exp2_scale - base) and returns this thread's sum of it.
  template <typename ScoresRC>
  __device__ __forceinline__ float exponentiate_row(ScoresRC& scores, int r, float base) const {
    using namespace cute;
    float sum = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      const float p = exp2_ftz(fmaf(scores(r, c), exp2_scale, -base));
      scores(r, c) = p;
      sum += p;
    }
    return sum;
  }

  // The LSE finalize() gives a row that saw no visible key (row_max = -inf, row_sum = 0): the sink's logit, or -inf
  // without one. For tiles whose rows are all empty, which never run the mainloop.
  __device__ __forceinline__ static void lse_of_empty_rows(const float (&sink_log2)[kRows], float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) lse[r] = sink_log2[r] == -INFINITY ? -INFINITY : sink_log2[r] * kLn2;
  }

  // Normalizes acc_o and returns each row's LSE in natural-log units through lse[r].
  // sink_log2 is the row's sink logit times log2(e), or -inf without sinks. The sink joins the denominator with no
  // value; it is folded in at a common maximum m = max(row max, sink) so a sink far above the scores cannot
  // overflow exp2. Empty rows: without a sink m = -inf, out = 0, lse = -inf; with one, out = 0, lse = sink.
  // The rows may have sinks of their own (rows of several heads in one tile), or share one (the overload below).
  template <typename AccORC>
  __device__ __forceinline__ void finalize(AccORC& acc_o, const float (&sink_log2)[kRows], float (&lse)[kRows]) const {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_allreduce(row_sum[r], SumOp{});
      const float scores_max = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * exp2_scale;
      const float common_max = fmaxf(scores_max, sink_log2[r]);
      float out_scale = 0.f;
      lse[r] = -INFINITY;
      if (common_max != -INFINITY) {
        // The approximate forms suffice and keep this per-tile step short (the IEEE division and log2f are ~40
        // instructions each per row, on the path between a tile's last GEMM and the next tile's first): both
        // exponents are <= 0, and the denominator is >= 1 (its largest term is exp2(0)), far from the ranges where
        // ex2/lg2.approx or the fast division lose accuracy.
        const float scores_weight = exp2_ftz(scores_max - common_max);
        const float denominator = sum * scores_weight + exp2_ftz(sink_log2[r] - common_max);
        out_scale = __fdividef(scores_weight, denominator);
        lse[r] = (common_max + log2_approx(denominator)) * kLn2;
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= out_scale;
    }
  }
  template <typename AccORC>
  __device__ __forceinline__ void finalize(AccORC& acc_o, float sink_log2, float (&lse)[kRows]) const {
    float sinks[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) sinks[r] = sink_log2;
    finalize(acc_o, sinks, lse);
  }
};

}  // namespace flashjax::common

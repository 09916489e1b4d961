// Elementwise math of one backward step on the thread's (row, col) fragment views:
//   P  = exp2(s * exp2_scale - lse_log2)       recomputed from the forward's LSE (sink term included)
//   dS = P * g * (dP - D'_row)                  g = 1 - tanh^2 with softcap (d capped / d raw), else 1
// The scale that turns dS into dQ / dK is applied later (postprocess, dK epilogue).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "kernels/common/fast_math.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"

namespace flashjax::sm80 {

// Where softmax_scale and the softcap c enter. Without softcap the fragment keeps raw q·k and the scale folds into
// the exp2 argument (one FFMA per score). With softcap the fragment becomes t = tanh(q·k * scale / c) and the
// exp2 scale is c * log2(e).
struct BwdScoreScales {
  bool has_softcap;
  float tanh_prescale;  // scale / c
  float exp2_scale;     // multiplies the fragment to give log2-domain logits

  __device__ BwdScoreScales(float softmax_scale, float softcap)
      : has_softcap(softcap > 0.f),
        tanh_prescale(softcap > 0.f ? softmax_scale / softcap : 0.f),
        exp2_scale((softcap > 0.f ? softcap : softmax_scale) * common::kLog2e) {}
};

// Accurate tanhf, as in the forward: P must be recomputed from the same logits that produced the forward's LSE,
// and tanh.approx's ~2^-11 relative error times c (~30) would move logits by ~1e-2.
template <typename AccS>
__device__ __forceinline__ void apply_softcap(AccS& acc_s, float tanh_prescale) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc_s); ++i) acc_s(i) = tanhf(acc_s(i) * tanh_prescale);
}

// acc_s holds the masked scores (-inf where invisible): raw q·k without softcap, tanh(scale q·k / c) with it.
// Writes P in Element to rP (for dV = P^T dO, through shared memory) and replaces acc_s by P * g in f32, the factor
// dS needs. lse_log2 is +inf on empty and padding rows, so P = exp2(-inf) = 0 there, never NaN.
template <bool kSoftcap, typename AccS, typename FragP, typename RowVec>
__device__ __forceinline__ void probs_from_scores(AccS& acc_s, FragP& rP, const RowVec& lse_log2, float exp2_scale) {
  using namespace cute;
  using Element = typename FragP::value_type;
  auto s_rc = common::acc_rowcol_view(acc_s);
  auto p_rc = common::acc_rowcol_view(rP);
  cutlass::NumericArrayConverter<Element, float, 2> to_element;  // one cvt.rn.{bf16x2,f16x2}.f32 per column pair
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s_rc); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s_rc); ni += 2) {
      cutlass::Array<float, 2> p;
      CUTE_UNROLL
      for (int j = 0; j < 2; ++j) {
        const float s = s_rc(mi, ni + j);
        p[j] = common::exp2_ftz(s * exp2_scale - lse_log2(mi));
        // tanh' = 1 - t^2 is in [0, 1] for |t| <= 1; the clamp maps masked t = -inf to 0 instead of 0 * -inf = NaN.
        s_rc(mi, ni + j) = kSoftcap ? p[j] * fmaxf(1.f - s * s, 0.f) : p[j];
      }
      const auto packed = to_element(p);
      p_rc(mi, ni) = packed[0];
      p_rc(mi, ni + 1) = packed[1];
    }
  }
}

// acc_dp (dP = dO V^T) becomes dS = dp_factor * (dP - D'_row), dp_factor being probs_from_scores' acc_s.
template <typename AccDp, typename AccS, typename RowVec>
__device__ __forceinline__ void ds_from_dp(AccDp& acc_dp, const AccS& dp_factor, const RowVec& dpsum) {
  using namespace cute;
  auto dp_rc = common::acc_rowcol_view(acc_dp);
  const auto f_rc = common::acc_rowcol_view(dp_factor);
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(dp_rc); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(dp_rc); ++ni) dp_rc(mi, ni) = f_rc(mi, ni) * (dp_rc(mi, ni) - dpsum(mi));
  }
}

}  // namespace flashjax::sm80

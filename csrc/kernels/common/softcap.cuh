// Score soft-capping (docs/design.md §2.1): s = c * tanh(scale * qk / c), applied before masking.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/fast_math.cuh"

namespace flashjax::common {

// How raw q·k accumulators become exp2 arguments. Without softcap the scale is folded into the exp2 argument
// (one FFMA per score); with softcap the fragment is first replaced by tanh(qk * scale / c) in [-1, 1] and the
// remaining factor c moves into the exp2 scale. Either way the online softmax sees values whose ordering matches
// the true scores, so its running max is valid; without softcap that needs softmax_scale > 0 (a negative scale
// would turn the running max into a running min, and 0 would turn masked -inf scores into NaN).
struct ScoreTransform {
  float softcap;               // > 0: apply tanh capping
  float tanh_prescale_2log2e;  // 2 * log2(e) * softmax_scale / softcap: the exp2 argument of tanh's exponential
  float exp2_scale;            // multiplies the (possibly capped) fragment to give log2-domain logits

  __host__ __device__ ScoreTransform(float softmax_scale, float softcap_)
      : softcap(softcap_),
        tanh_prescale_2log2e(softcap_ > 0.f ? 2.f * kLog2e * softmax_scale / softcap_ : 0.f),
        exp2_scale(softcap_ > 0.f ? softcap_ * kLog2e : softmax_scale * kLog2e) {}

  // tanh(x) = 1 - 2 / (2^(2x log2 e) + 1) on the special-function unit (ex2, rcp), not tanhf: the accurate libm
  // sequence keeps so many temporaries live next to the S and O accumulators that it forced ~300 bytes of register
  // spills. What matters is the absolute error of the capped logit c * tanh (it becomes a relative error of P):
  // ~3e-7 * c here, ~1e-5 for c = 30, against ~1e-2 for tanh.approx. Saturates cleanly: 2^(+big) = inf gives 1,
  // 2^(-big) = 0 gives -1.
  // The uniform runtime branch does not guarantee that only capped calls pay: ptxas may if-convert it, so that
  // uncapped calls issue the whole sequence predicated off (5 instructions per score; ~27% of the sm80 forward
  // mainloop's issue slots). Hot loops should call it only from code compiled for the capped case (see
  // sm80/fwd_kernel.cuh).
  template <typename Fragment>
  __device__ __forceinline__ void apply_softcap(Fragment& scores) const {
    if (softcap > 0.f) {
      CUTE_UNROLL
      for (int i = 0; i < cute::size(scores); ++i) {
        const float e2x = exp2_ftz(scores(i) * tanh_prescale_2log2e);
        scores(i) = 1.f - __fdividef(2.f, e2x + 1.f);
      }
    }
  }
};

}  // namespace flashjax::common

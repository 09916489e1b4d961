// Scalar and warp-level math helpers shared by every kernel family.
#pragma once

#include <cuda_runtime.h>

namespace flashjax::common {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): turns exp(x) into exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): turns a log2 value back into natural units

// 2^x on the special-function unit, flushing subnormal inputs/results to zero.
// Softmax probabilities are exp2(s - max) <= 1 and the row sum is >= 1 (the max term), so a value under 2^-126
// contributes nothing representable; flushing it costs no accuracy and avoids the subnormal fix-up sequence
// that plain exp2f compiles to without --use_fast_math. ex2.approx is accurate to ~2 ulp, far below the
// bf16/fp16 rounding of P. exp2(-inf) = +0, which masking relies on.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) on the special-function unit: ~2^-22 relative error for normal x (OnlineSoftmax::finalize takes it of
// a denominator >= 1); subnormal inputs are flushed to zero.
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// All-reduce across the 4 consecutive lanes that share an accumulator row in mma.sync m16n8 (and wgmma)
// fragments: lane = 4 * row_group + column_pair.
template <typename Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 2));
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return x;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace flashjax::common

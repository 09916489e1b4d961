// Backward postprocess: dq = softmax_scale * dq_accum, converted to Element and stored with dq's strides.
// The main kernel accumulates dS K unscaled in f32 (atomics from every KV block); the scale is applied once here.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flashjax/params.h"
#include "kernels/sm80/bwd_preprocess.cuh"

namespace flashjax::sm80 {

// Grid: (ceil(seqlen_q / kRowsPerBlock), heads_q, batch); same row-to-thread mapping as the preprocess.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(BwdRowPassShape::kThreads) bwd_postprocess_kernel(const BwdParams params) {
  using Pass = BwdRowPassShape;
  static_assert(Pass::kVec == 4, "one float4 of dq_accum per access");
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int row = blockIdx.x * Pass::kRowsPerBlock + threadIdx.x / Pass::kThreadsPerRow;
  if (row >= params.seqlen_q) return;
  const int lane_in_row = threadIdx.x % Pass::kThreadsPerRow;

  const float* accum_row =
      params.dq_accum + ((int64_t(batch) * params.heads_q + head) * params.seqlen_q_rounded + row) * kHeadDim;
  auto* dq_row = static_cast<Element*>(params.dq) + batch * params.dq_batch_stride + row * params.dq_row_stride +
                 head * params.dq_head_stride;
  cutlass::NumericArrayConverter<Element, float, Pass::kVec> to_element;
#pragma unroll
  for (int c = lane_in_row * Pass::kVec; c < kHeadDim; c += Pass::kThreadsPerRow * Pass::kVec) {
    const float4 acc = *reinterpret_cast<const float4*>(accum_row + c);
    cutlass::Array<float, Pass::kVec> scaled;
    scaled[0] = acc.x * params.softmax_scale;
    scaled[1] = acc.y * params.softmax_scale;
    scaled[2] = acc.z * params.softmax_scale;
    scaled[3] = acc.w * params.softmax_scale;
    const cutlass::Array<Element, Pass::kVec> converted = to_element(scaled);
    *reinterpret_cast<uint2*>(dq_row + c) = reinterpret_cast<const uint2&>(converted);  // one 8-byte store
  }
}

}  // namespace flashjax::sm80

// Backward preprocess: one pass over the query rows before the main kernel.
//   dpsum[row]    = D'_row = rowsum(dO ∘ O) - dlse_row   (the row term of dS = P ∘ (dP - D'))
//   lse_log2[row] = lse_row * log2(e), or +inf for an empty row (lse = -inf) and for padding rows, so that the
//                   main kernel's P = exp2(s - lse_log2) is exactly 0 there instead of inf or NaN
//   dq_accum      = 0 over the whole padded [Sq_rounded, D] slab (the main kernel only adds into it)
//   dsinks[h]    += -sum_row exp(sink_h - lse_row) * D'_row   (one atomic per block; zeroed by the launcher), or
//                   with deterministic=True the same sum in a fixed order by bwd_dsinks_ordered_kernel afterwards
// Varlen: each query head's slab holds the packed sequences' rows as bwd_tile_scheduler.cuh places them; a slab row
// that stands for no used query row (between sequences, past seqused) is padding.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flashjax/params.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/sm80/bwd_tile_scheduler.cuh"
#include "kernels/sm80/bwd_tile_sizes.cuh"

namespace flashjax::sm80 {

struct BwdRowPassShape {
  static constexpr int kThreads = 256;
  static constexpr int kThreadsPerRow = 8;  // a power of two dividing 32: a row's threads share one warp
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
  static constexpr int kVec = 4;  // elements per 8-byte access: every compiled head dim is a multiple of 32
  static_assert(kBwdSeqlenQRounding % kRowsPerBlock == 0, "blocks must tile the workspace's row padding");
};

// Grid: (seqlen_q_rounded / kRowsPerBlock, heads_q, batch); varlen batch 1, the slab rows of bwd_varlen_rows.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(BwdRowPassShape::kThreads) bwd_preprocess_kernel(const BwdParams params) {
  using Pass = BwdRowPassShape;
  static_assert(kHeadDim % (Pass::kVec * Pass::kThreadsPerRow) == 0 && Pass::kVec * sizeof(Element) == sizeof(uint2));
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int slab_row = blockIdx.x * Pass::kRowsPerBlock + threadIdx.x / Pass::kThreadsPerRow;
  const int row = bwd_row_of_slab_row(params, slab_row);  // of q / o / lse; -1: a padding row
  const int lane_in_row = threadIdx.x % Pass::kThreadsPerRow;

  float dot = 0.f;
  if (row >= 0) {
    const auto* o_row = static_cast<const Element*>(params.o) + batch * params.o_batch_stride +
                        row * params.o_row_stride + head * params.o_head_stride;
    const auto* do_row = static_cast<const Element*>(params.dout) + batch * params.do_batch_stride +
                         row * params.do_row_stride + head * params.do_head_stride;
    cutlass::NumericArrayConverter<float, Element, Pass::kVec> to_float;
#pragma unroll
    for (int c = lane_in_row * Pass::kVec; c < kHeadDim; c += Pass::kThreadsPerRow * Pass::kVec) {
      const uint2 o_bits = *reinterpret_cast<const uint2*>(o_row + c);  // one 8-byte load per tensor
      const uint2 do_bits = *reinterpret_cast<const uint2*>(do_row + c);
      const auto o = to_float(reinterpret_cast<const cutlass::Array<Element, Pass::kVec>&>(o_bits));
      const auto d = to_float(reinterpret_cast<const cutlass::Array<Element, Pass::kVec>&>(do_bits));
#pragma unroll
      for (int i = 0; i < Pass::kVec; ++i) dot += o[i] * d[i];
    }
  }
#pragma unroll
  for (int lanes = Pass::kThreadsPerRow / 2; lanes > 0; lanes /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, lanes);

  float dsink = 0.f;  // this row's term of dsinks[head]; nonzero only on the row's first thread
  if (lane_in_row == 0) {
    const int64_t ws_row = (int64_t(batch) * params.heads_q + head) * params.seqlen_q_rounded + slab_row;
    float dpsum = 0.f;
    float lse_log2 = INFINITY;
    if (row >= 0) {
      const int64_t lse_idx = batch * params.lse_batch_stride + head * params.lse_head_stride + row;
      const float lse = params.lse[lse_idx];
      dpsum = dot - (params.dlse != nullptr ? params.dlse[lse_idx] : 0.f);
      if (lse != -INFINITY) {
        lse_log2 = lse * common::kLog2e;
        if (params.sinks != nullptr) dsink = -expf(params.sinks[head] - lse) * dpsum;
      }
    }
    params.dpsum[ws_row] = dpsum;
    params.lse_log2[ws_row] = lse_log2;
  }

  // The block's rows of dq_accum are contiguous: kRowsPerBlock * D floats, cleared with 16-byte stores.
  auto* dq_accum =
      reinterpret_cast<float4*>(params.dq_accum + ((int64_t(batch) * params.heads_q + head) * params.seqlen_q_rounded +
                                                   blockIdx.x * Pass::kRowsPerBlock) *
                                                      kHeadDim);
  for (int i = threadIdx.x; i < Pass::kRowsPerBlock * kHeadDim / 4; i += Pass::kThreads) {
    dq_accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  if (params.sinks != nullptr && !params.deterministic) {
    __shared__ float warp_sums[Pass::kThreads / 32];
#pragma unroll
    for (int lanes = 16; lanes > 0; lanes /= 2) dsink += __shfl_xor_sync(0xffffffffu, dsink, lanes);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dsink;
    __syncthreads();
    if (threadIdx.x == 0) {
      float block_sum = 0.f;
#pragma unroll
      for (int w = 0; w < Pass::kThreads / 32; ++w) block_sum += warp_sums[w];
      atomicAdd(params.dsinks + head, block_sum);
    }
  }
}

// deterministic=True: dsinks[h] = -sum over (batch, row) of exp2(sink_h log2e - lse_log2) * D', from the row pass's
// workspace (empty and padding rows have lse_log2 = +inf: no term), in one fixed order: thread t takes every
// kThreads-th row, then a fixed tree over the threads. Overwrites dsinks. Grid: (heads_q), kThreads threads (a
// template so that the header defines it in every file that includes it without clashing).
template <int kThreads = BwdRowPassShape::kThreads>
__global__ void __launch_bounds__(kThreads) bwd_dsinks_ordered_kernel(const BwdParams params) {
  static_assert((kThreads & (kThreads - 1)) == 0, "the tree halves the threads");
  const int head = blockIdx.x;
  const float sink_log2 = params.sinks[head] * common::kLog2e;
  float sum = 0.f;
  for (int batch = 0; batch < params.batch; ++batch) {
    const int64_t first = (int64_t(batch) * params.heads_q + head) * params.seqlen_q_rounded;
    for (int row = threadIdx.x; row < params.seqlen_q_rounded; row += kThreads) {
      sum += exp2f(sink_log2 - params.lse_log2[first + row]) * params.dpsum[first + row];
    }
  }
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
#pragma unroll
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) params.dsinks[head] = -partial[0];
}

}  // namespace flashjax::sm80

// Backward postprocess: dq = softmax_scale * dq_accum, converted to Element and stored with dq's strides.
// The main kernel accumulates dS K unscaled in f32 (atomics from every KV block); the scale is applied once here.
// dq_accum is in the main kernel's fragment order (bwd_dq_accum.cuh), so each CTA takes one M block with the main
// kernel's thread count and dQ MMA: thread t reads back exactly the values thread t added, with 16-byte coalesced
// loads, and knows their (row, col) from the same accumulator partition.
#pragma once

#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flashjax/params.h"
#include "kernels/sm80/bwd_dq_accum.cuh"
#include "kernels/sm80/bwd_tile_scheduler.cuh"

namespace flashjax::sm80 {

// Grid: BwdBlockScheduler<kBlockM, queries>::grid (varlen: virtual M blocks, of which those outside their sequence's
// used rows have no work: the launcher zeroed dq there); Layouts::kNThreads threads.
template <typename Layouts>
__global__ void __launch_bounds__(Layouts::kNThreads) bwd_postprocess_kernel(const BwdParams params) {
  using namespace cute;
  using Element = typename Layouts::Element;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kDqCols = Layouts::kDqCols;
  const BwdBlock tile = BwdBlockScheduler<kBlockM, /*kKeys=*/false>::block(params);
  const int m_block = tile.block;
  const int head = tile.head;
  const int batch = tile.seq.batch;
  const int valid_rows = tile.seq.seqlen_q - m_block * kBlockM;
  if (m_block < 0 || valid_rows <= 0) return;

  typename Layouts::TiledMmaDq mma_dq;
  const auto coords = mma_dq.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kDqCols>>{}));
  constexpr int kValues = decltype(size(coords))::value;
  static_assert(kValues % kDqAccumVec == 0);
  auto* dq_block = static_cast<Element*>(params.dq) + batch * params.dq_batch_stride + head * params.dq_head_stride +
                   (int64_t(tile.seq.q_start) + m_block * kBlockM) * params.dq_row_stride;
  cutlass::NumericArrayConverter<Element, float, 2> to_element;

  CUTE_UNROLL
  for (int chunk = 0; chunk < Layouts::kDqChunks; ++chunk) {
    const float* chunk_accum = params.dq_accum + dq_accum_chunk_start<Layouts>(
                                                     params, batch, head, tile.seq.ws_start + m_block * kBlockM, chunk);
    CUTE_UNROLL
    for (int i = 0; i < kValues; i += kDqAccumVec) {
      const float4 acc = *reinterpret_cast<const float4*>(chunk_accum + dq_accum_offset<Layouts>(i, threadIdx.x));
      const float values[kDqAccumVec] = {acc.x, acc.y, acc.z, acc.w};
      // Accumulator values 2k and 2k + 1 are adjacent columns of one row: one 4-byte store per pair.
      CUTE_UNROLL
      for (int j = 0; j < kDqAccumVec; j += 2) {
        const int row = get<0>(coords(i + j));
        if (row >= valid_rows) continue;
        cutlass::Array<float, 2> scaled;
        scaled[0] = values[j] * params.softmax_scale;
        scaled[1] = values[j + 1] * params.softmax_scale;
        const cutlass::Array<Element, 2> converted = to_element(scaled);
        *reinterpret_cast<uint32_t*>(dq_block + row * params.dq_row_stride + chunk * kDqCols + get<1>(coords(i + j))) =
            reinterpret_cast<const uint32_t&>(converted);
      }
    }
  }
}

}  // namespace flashjax::sm80

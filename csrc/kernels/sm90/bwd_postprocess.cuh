// Backward postprocess of the sm90 family: dq = softmax_scale * dq_accum, converted to Element and stored with dq's
// strides. The main kernel's dQ writer added each step's dQ into the f32 workspace, query block by query block, in
// the order the MMA warpgroups staged it (BwdMainloopSm90's dQ staging: each warpgroup's share in its TiledMmaDq
// fragment order, float4 j of thread t at (j * 128 + t) * 4). So each CTA takes one query block with the main
// kernel's MMA thread count and dQ MMA: thread t reads back, with coalesced 16-byte loads, exactly what thread t of
// the main kernel staged, and knows its (row, col) from the same accumulator partition.
// Varlen (kVarlen): grid (virtual query block, Hq, 1); a CTA converts its sequence's used rows of its block, read
// from the sequence's workspace rows (bwd_varlen_scheduler.cuh); blocks with no used rows do nothing (the launcher
// zeroed dq there).
#pragma once

#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flashjax/params.h"
#include "kernels/sm90/bwd_varlen_scheduler.cuh"

namespace flashjax::sm90 {

// Grid: (ceil(seqlen_q / kBlockM), heads_q, batch), varlen (BwdVarlenSchedulerSm90<kBlockM, queries>::num_blocks,
// heads_q, 1); Mainloop::kMmaThreads threads.
template <typename Mainloop, bool kVarlen = false>
__global__ void __launch_bounds__(Mainloop::kMmaThreads) bwd_postprocess_kernel_sm90(const BwdParams params) {
  using namespace cute;
  using Element = typename Mainloop::Element;
  constexpr int kBlockM = Mainloop::kBlockM;
  using Scheduler = BwdVarlenSchedulerSm90<kBlockM, /*kKeys=*/false>;
  BwdVarlenBlock seq{};
  if constexpr (kVarlen) {
    seq = Scheduler::block(params, blockIdx.x);
    if (!Scheduler::has_work(seq)) return;
  }
  const int m_block = kVarlen ? seq.block : int(blockIdx.x);
  const int head = blockIdx.y;
  const int batch = blockIdx.z;  // varlen: 0
  const int thread_in_wg = threadIdx.x % 128;
  typename Mainloop::TiledMmaDq mma_dq;
  const Tensor coords = mma_dq.get_thread_slice(threadIdx.x)
                            .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<Mainloop::kHeadDim>>{}));
  constexpr int kValues = decltype(size(coords))::value;
  static_assert(kValues % 4 == 0);
  const float4* part = reinterpret_cast<const float4*>(
      params.dq_accum +
      (Mainloop::Steps::row_offset(params.heads_q, params.seqlen_q_rounded, batch, head, m_block) +
       (kVarlen ? seq.ws_start : 0)) *
          Mainloop::kHeadDim +
      (threadIdx.x / 128) * Mainloop::kDqPartFloats);
  const int valid_rows = (kVarlen ? seq.seqlen_q : params.seqlen_q) - m_block * kBlockM;
  auto* dq_block = static_cast<Element*>(params.dq) + batch * params.dq_batch_stride + head * params.dq_head_stride +
                   (kVarlen ? int64_t(seq.q_start) * params.dq_row_stride : 0) +
                   int64_t(m_block) * kBlockM * params.dq_row_stride;
  cutlass::NumericArrayConverter<Element, float, 2> to_element;
  CUTE_UNROLL
  for (int j = 0; j < kValues / 4; ++j) {
    const float4 acc = part[j * 128 + thread_in_wg];
    const float values[4] = {acc.x, acc.y, acc.z, acc.w};
    // Accumulator values 2k and 2k + 1 are adjacent columns of one row: one 4-byte store per pair.
    CUTE_UNROLL
    for (int c = 0; c < 4; c += 2) {
      const int row = get<0>(coords(4 * j + c));
      if (row >= valid_rows) continue;
      const cutlass::Array<float, 2> scaled = {values[c] * params.softmax_scale, values[c + 1] * params.softmax_scale};
      const auto converted = to_element(scaled);
      *reinterpret_cast<uint32_t*>(dq_block + int64_t(row) * params.dq_row_stride + get<1>(coords(4 * j + c))) =
          reinterpret_cast<const uint32_t&>(converted);
    }
  }
}

}  // namespace flashjax::sm90

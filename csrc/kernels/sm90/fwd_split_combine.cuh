// The second kernel of a split-keys forward (fwd_split_kv.h): merges each query row's num_splits partial results
// from the workspace (O_s normalized by its own sum, LSE_s without the sink) into O and LSE:
//   lse = log(sum_s exp(LSE_s) + exp(sink)),   O = sum_s exp(LSE_s - lse) O_s,
// so a row that no part and no sink sees gets lse = -inf and O = 0, as the unsplit kernel writes it. One warp per
// row: the lanes share the parts' LSEs, then each lane sums D / 32 columns over the parts (coalesced reads).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "flashjax/params.h"

namespace flashjax::sm90 {

constexpr int kCombineWarps = 4;  // rows per block

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) fwd_split_combine_kernel(const __grid_constant__ FwdParams p) {
  static_assert(kHeadDim % 32 == 0, "each lane owns kHeadDim / 32 columns");
  constexpr int kCols = kHeadDim / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / 32;  // over [B, Hq, Sq]
  if (row >= int64_t(p.batch) * p.heads_q * p.seqlen_q) return;
  const int position = static_cast<int>(row % p.seqlen_q);
  const int head = static_cast<int>(row / p.seqlen_q % p.heads_q);
  const int batch = static_cast<int>(row / (int64_t(p.seqlen_q) * p.heads_q));
  // Launched programmatically (fwd_launch.cuh): wait for the split kernel's parts (its completion and its memory),
  // then let the stream's next kernel launch, which waits for this one the same way. No-ops without PDL.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t part_stride = int64_t(p.heads_q) * p.seqlen_q;  // between consecutive parts of one row
  const int64_t first_part = (int64_t(batch) * p.num_splits * p.heads_q + head) * p.seqlen_q + position;

  float max_lse = p.sinks != nullptr ? p.sinks[head] : -INFINITY;
  for (int s = lane; s < p.num_splits; s += 32) max_lse = fmaxf(max_lse, p.lse_partial[first_part + s * part_stride]);
  for (int offset = 16; offset > 0; offset /= 2) {
    max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
  }
  float lse = -INFINITY;
  if (max_lse != -INFINITY) {
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(p.lse_partial[first_part + s * part_stride] - max_lse);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (p.sinks != nullptr) sum += expf(p.sinks[head] - max_lse);
    lse = max_lse + logf(sum);
  }

  float acc[kCols] = {};
  if (lse != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float weight = expf(p.lse_partial[first_part + s * part_stride] - lse);
      if (weight == 0.f) continue;  // an empty part (LSE -inf); its O is 0 anyway
      const float* o_part = p.o_partial + (first_part + s * part_stride) * kHeadDim;
      for (int j = 0; j < kCols; ++j) acc[j] += weight * o_part[lane + 32 * j];
    }
  }
  Element* o = static_cast<Element*>(p.o) + batch * p.o_batch_stride + position * p.o_row_stride +
               head * p.o_head_stride;
  for (int j = 0; j < kCols; ++j) o[lane + 32 * j] = Element(acc[j]);
  if (lane == 0 && p.lse != nullptr) p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + position] = lse;
}

}  // namespace flashjax::sm90

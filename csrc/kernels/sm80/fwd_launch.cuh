// Host launcher of the sm80-family forward kernel: defines flashjax::sm80::run_fwd (declared in launch.h).
// Included by the generated instantiation files, one per (Element, head dim).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "flashjax/params.h"
#include "kernels/common/mask_bits_tiles.cuh"
#include "kernels/sm80/fwd_kernel.cuh"
#include "kernels/sm80/fwd_layouts.cuh"
#include "kernels/sm80/fwd_tile_scheduler.cuh"
#include "kernels/sm80/launch.h"

namespace flashjax::sm80 {

// A template so that the many generated translation units including this header share one definition.
template <typename T>
__global__ void fill_kernel(T* data, int64_t count, T value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    data[i] = value;
  }
}

// Varlen: the rows no tile stores (past a sequence's seqused, outside every sequence, or left out by malformed
// offsets) are defined as the reference defines unused rows, out = 0 and lse = -inf, by filling o and lse before the
// kernel (stream-ordered; lse [Hq, Tq] is contiguous, o the handler's contiguous [Tq, Hq, D]).
template <typename Element>
cudaError_t fill_varlen_outputs(const FwdParams& params, cudaStream_t stream) {
  const int64_t rows = int64_t(params.seqlen_q) * params.heads_q;
  cudaError_t err = cudaMemsetAsync(params.o, 0, rows * params.head_dim * sizeof(Element), stream);
  if (err != cudaSuccess || params.lse == nullptr || rows == 0) return err;
  const int64_t blocks = std::min<int64_t>((rows + 255) / 256, 4096);
  fill_kernel<float><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(params.lse, rows, -INFINITY);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim, int kSmemKB>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Layouts = FwdLayouts<Element, kHeadDim, kSmemKB>;
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0) {
    return cudaErrorInvalidValue;
  }
  if (params.cu_seqlens_q != nullptr) {
    if (params.batch != 1 || params.num_seqs < 0) return cudaErrorInvalidValue;
    if (const cudaError_t err = fill_varlen_outputs<Element>(params, stream); err != cudaSuccess) return err;
  }
  const int64_t num_ctas = FwdTileScheduler<Layouts::kBlockM>::num_ctas(params);
  if (num_ctas == 0) return cudaSuccess;  // Sq = 0 (or B = 0): nothing to write; a 0-CTA launch would be an error
  if (num_ctas > INT_MAX) return cudaErrorInvalidConfiguration;

  // A mask mod: the tile classes for this kernel's tiles first (kernels/common/mask_bits_tiles.cuh), same stream.
  const bool mask_mod = params.mask_bits != nullptr;
  // Varlen: the classes of the bits' padded grid, N sequences of max_seqlen_q x Wk * 32 (flashjax/mask_grid.h).
  if (mask_mod) {
    const cudaError_t err =
        common::launch_mask_bits_tiles<Layouts::kBlockM, Layouts::kBlockN>(mask_bits_grid(params), stream);
    if (err != cudaSuccess) return err;
  }
  // Same condition as ScoreTransform::apply_softcap: the uncapped kernel runs only where capping is a no-op.
  const bool capped = params.softcap > 0.f;
  auto kernel = mask_mod ? (capped ? fwd_kernel_sm80<Layouts, true, true> : fwd_kernel_sm80<Layouts, false, true>)
                         : (capped ? fwd_kernel_sm80<Layouts, true, false> : fwd_kernel_sm80<Layouts, false, false>);
  constexpr int kSmemBytes = Layouts::kSmemBytes;
  // Above 48 KB dynamic shared memory is opt-in per kernel. Setting an attribute is not a stream operation, so it
  // is legal during CUDA-graph capture.
  if (kSmemBytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(num_ctas), Layouts::kNThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// Declared in launch.h: the dynamic shared memory run_fwd launches with (both softcap variants share the layouts).
template <typename Element, int kHeadDim, int kSmemKB>
int fwd_smem_bytes() {
  constexpr int kSmemBytes = FwdLayouts<Element, kHeadDim, kSmemKB>::kSmemBytes;
  return kSmemBytes;
}

// Declared in launch.h: one tile configuration whatever the call: fwd_tile_sizes' for this head dim and budget.
template <typename Element, int kHeadDim, int kSmemKB>
FamilyChoices fwd_choices(const AttnShape&, const ChoiceQuery& query) {
  using Layouts = FwdLayouts<Element, kHeadDim, kSmemKB>;
  FamilyChoices choices;
  choices.block_m = Layouts::kBlockM;
  choices.block_n = Layouts::kBlockN;
  if (query.explain) {
    choices.tile_reason = std::to_string(choices.block_m) + " x " + std::to_string(choices.block_n) +
                          " tiles (the family's configuration for this head dim in " + std::to_string(kSmemKB) +
                          " KB of shared memory per block: " + std::to_string(Layouts::kSmemBytes / 1024) + " KB)";
  }
  return choices;
}

}  // namespace flashjax::sm80

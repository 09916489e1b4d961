// Host launcher of the sm80-family forward kernel: defines flashjax::sm80::run_fwd (declared in launch.h).
// Included by the generated instantiation files, one per (Element, head dim).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "flashjax/params.h"
#include "kernels/sm80/fwd_kernel.cuh"
#include "kernels/sm80/fwd_layouts.cuh"
#include "kernels/sm80/fwd_tile_scheduler.cuh"
#include "kernels/sm80/launch.h"

namespace flashjax::sm80 {

template <typename Element, int kHeadDim, int kSmemKB>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Layouts = FwdLayouts<Element, kHeadDim, kSmemKB>;
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_ctas = FwdTileScheduler<Layouts::kBlockM>::num_ctas(params);
  if (num_ctas == 0) return cudaSuccess;  // Sq = 0 (or B = 0): nothing to write; a 0-CTA launch would be an error
  if (num_ctas > INT_MAX) return cudaErrorInvalidConfiguration;

  // Same condition as ScoreTransform::apply_softcap: the uncapped kernel runs only where capping is a no-op.
  auto kernel = params.softcap > 0.f ? fwd_kernel_sm80<Layouts, true> : fwd_kernel_sm80<Layouts, false>;
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

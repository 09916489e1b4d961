// Host launcher of the sm80-family tangent kernel: defines flashjax::sm80::run_tangent, tangent_smem_bytes and
// tangent_choices (declared in launch.h). Included by the generated instantiation files, one per (Element, head dim,
// shared-memory budget). One launch, no workspace; never synchronizes, allocates or reads device memory.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "flashjax/params.h"
#include "kernels/sm80/fwd_tile_scheduler.cuh"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/tangent_kernel.cuh"
#include "kernels/sm80/tangent_layouts.cuh"

namespace flashjax::sm80 {

template <typename Element, int kHeadDim, int kSmemKB>
cudaError_t run_tangent(const TangentParams& params, cudaStream_t stream) {
  using Layouts = TangentLayouts<Element, kHeadDim, kSmemKB>;
  // Varlen tangents are not wired (dispatch refuses them; the kernel's scheduler would take them, but the rows no
  // tile stores would need the forward's prefill).
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0 ||
      params.cu_seqlens_q != nullptr || (params.sinks != nullptr) != (params.tsinks != nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_ctas = FwdTileScheduler<Layouts::kBlockM>::num_ctas(params);
  if (num_ctas == 0) return cudaSuccess;  // Sq = 0 (or B = 0): nothing to write
  if (num_ctas > INT_MAX) return cudaErrorInvalidConfiguration;

  auto kernel = params.softcap > 0.f ? tangent_kernel_sm80<Layouts, true> : tangent_kernel_sm80<Layouts, false>;
  constexpr int kSmemBytes = Layouts::kSmemBytes;
  if (kSmemBytes > 48 * 1024) {  // opt-in above 48 KB; legal during CUDA-graph capture (fwd_launch.cuh)
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(num_ctas), Layouts::kNThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// Declared in launch.h: the dynamic shared memory run_tangent launches with (both softcap twins share the layouts).
template <typename Element, int kHeadDim, int kSmemKB>
int tangent_smem_bytes() {
  constexpr int kSmemBytes = TangentLayouts<Element, kHeadDim, kSmemKB>::kSmemBytes;
  return kSmemBytes;
}

// Declared in launch.h: one tile configuration whatever the call: tangent_tile_sizes' for this head dim and budget.
template <typename Element, int kHeadDim, int kSmemKB>
FamilyChoices tangent_choices(const AttnShape&, const ChoiceQuery& query) {
  using Layouts = TangentLayouts<Element, kHeadDim, kSmemKB>;
  FamilyChoices choices;
  choices.block_m = Layouts::kBlockM;
  choices.block_n = Layouts::kBlockN;
  if (query.explain) {
    choices.tile_reason = std::to_string(choices.block_m) + " x " + std::to_string(choices.block_n) +
                          " tiles (the tangent's configuration for this head dim in " + std::to_string(kSmemKB) +
                          " KB of shared memory per block: " + std::to_string(Layouts::kSmemBytes / 1024) + " KB)";
  }
  return choices;
}

}  // namespace flashjax::sm80

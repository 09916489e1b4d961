// Host launcher of the sm80-family tangent kernel: defines flashjax::sm80::run_tangent, tangent_smem_bytes and
// tangent_choices (declared in launch.h). Included by the generated instantiation files, one per (Element, head dim,
// shared-memory budget). One launch (varlen: after two memsets; a mask mod: after the tile classification); never
// synchronizes, allocates or reads device memory.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "flashjax/params.h"
#include "kernels/common/mask_bits_tiles.cuh"
#include "kernels/sm80/fwd_tile_scheduler.cuh"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/tangent_kernel.cuh"
#include "kernels/sm80/tangent_layouts.cuh"

namespace flashjax::sm80 {

template <typename Element, int kHeadDim, int kSmemKB>
cudaError_t run_tangent(const TangentParams& params, cudaStream_t stream) {
  using Layouts = TangentLayouts<Element, kHeadDim, kSmemKB>;
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0 ||
      (params.sinks != nullptr) != (params.tsinks != nullptr) ||
      (params.mask_bits != nullptr && params.cu_seqlens_q != nullptr)) {  // varlen + mask mod: the reference's
    return cudaErrorInvalidValue;
  }
  if (params.cu_seqlens_q != nullptr) {
    // Varlen: the rows no tile stores (past a sequence's seqused, outside every sequence) have a constant primal (out
    // 0, lse -inf: fill_varlen_outputs), so their tangent is 0; both outputs are contiguous (the handler's [Tq, Hq,
    // D] and [Hq, Tq]) and all-zero bits are 0.f, so two memsets fill them before the kernel (stream-ordered).
    if (params.batch != 1 || params.num_seqs < 0) return cudaErrorInvalidValue;
    const int64_t rows = int64_t(params.seqlen_q) * params.heads_q;
    cudaError_t err = cudaMemsetAsync(params.t_out, 0, rows * params.head_dim * sizeof(Element), stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(params.t_lse, 0, rows * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t num_ctas = FwdTileScheduler<Layouts::kBlockM>::num_ctas(params);
  if (num_ctas == 0) return cudaSuccess;  // Sq = 0 (or B = 0): nothing to write
  if (num_ctas > INT_MAX) return cudaErrorInvalidConfiguration;

  // A mask mod: the tile classes for this kernel's tiles first (kernels/common/mask_bits_tiles.cuh), same stream.
  // The bits are words of 32 keys, so only instantiations whose key steps are whole words take them
  // (the 99 KB D 256 row's 16-key steps do not: gen_kernels.py leaves it out of MASK_MOD, so dispatch never sends it
  // a mask mod, and a call that reaches it anyway is refused here).
  const bool mask_mod = params.mask_bits != nullptr;
  constexpr bool kMaskModRow = Layouts::kBlockN % 32 == 0;
  if (mask_mod) {
    if constexpr (kMaskModRow) {
      const cudaError_t err = common::launch_mask_bits_tiles<Layouts::kBlockM, Layouts::kBlockN>(params, stream);
      if (err != cudaSuccess) return err;
    } else {
      return cudaErrorInvalidValue;
    }
  }
  const bool capped = params.softcap > 0.f;
  auto kernel = capped ? tangent_kernel_sm80<Layouts, true, false> : tangent_kernel_sm80<Layouts, false, false>;
  if constexpr (kMaskModRow) {
    if (mask_mod) {
      kernel = capped ? tangent_kernel_sm80<Layouts, true, true> : tangent_kernel_sm80<Layouts, false, true>;
    }
  }
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

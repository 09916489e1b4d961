// Host launcher of the sm80-family backward: preprocess -> main kernel -> postprocess, all on the caller's stream.
// Never synchronizes, allocates or reads device memory, so XLA can record it into a CUDA graph.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <string>

#include "flashjax/params.h"
#include "flashjax/workspace.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/mask_bits_tiles.cuh"
#include "kernels/common/varlen_gradients.h"
#include "kernels/sm80/bwd_kernel.cuh"
#include "kernels/sm80/bwd_layouts.cuh"
#include "kernels/sm80/bwd_postprocess.cuh"
#include "kernels/sm80/bwd_preprocess.cuh"
#include "kernels/sm80/bwd_tile_scheduler.cuh"
#include "kernels/sm80/bwd_tile_sizes.cuh"
#include "kernels/sm80/launch.h"

namespace flashjax::sm80 {

template <typename Element, int kHeadDim, int kSmemKB>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Layouts = BwdLayouts<Element, kHeadDim, kSmemKB>;
  using RowPass = BwdRowPassShape;
  const bool varlen = params.cu_seqlens_q != nullptr;
  // The workspace's rows per slab: Sq rounded, or varlen's per-sequence placement (flashjax/workspace.h).
  const int64_t slab_rows = varlen ? bwd_varlen_rows(params.seqlen_q, params.num_seqs)
                                   : int64_t(common::ceil_div(params.seqlen_q, kBwdSeqlenQRounding)) *
                                         kBwdSeqlenQRounding;
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0 ||
      params.seqlen_q_rounded < slab_rows || params.seqlen_q_rounded % kBwdSeqlenQRounding != 0 ||
      (varlen && (params.batch != 1 || params.num_seqs < 0)) ||
      params.deterministic) {  // its dq atomics land in any order: dispatch sends deterministic calls elsewhere
    return cudaErrorInvalidValue;
  }
  // dsinks is accumulated by the preprocess (one atomic per block), so it starts from zero.
  if (params.sinks != nullptr && params.heads_q > 0) {
    const cudaError_t err = cudaMemsetAsync(params.dsinks, 0, sizeof(float) * params.heads_q, stream);
    if (err != cudaSuccess) return err;
  }
  if (varlen) {
    if (const cudaError_t err = common::zero_varlen_gradients<Element>(params, stream); err != cudaSuccess) return err;
    if (params.num_seqs == 0) return cudaGetLastError();  // no sequence: zero gradients, dsinks 0
  }
  if (params.batch == 0 || params.heads_q == 0) return cudaGetLastError();

  // Preprocess covers every padded row: the main kernel reads lse_log2 / dpsum and adds into dq_accum there.
  if (params.seqlen_q_rounded > 0) {
    const dim3 grid(params.seqlen_q_rounded / RowPass::kRowsPerBlock, params.heads_q, params.batch);
    bwd_preprocess_kernel<Element, kHeadDim><<<grid, RowPass::kThreads, 0, stream>>>(params);
  }

  // With Sq = 0 the main kernel still runs: its CTAs visit no M block and write zero dK / dV.
  if (params.seqlen_k > 0) {
    // A mask mod: the tile classes for this kernel's tiles (kBlockM query rows per step x kBlockN keys per CTA),
    // same stream, after the preprocess and before the main kernel that reads them.
    const bool mask_mod = params.mask_bits != nullptr;
    if (mask_mod) {
      // Varlen: the classes of the bits' padded grid (flashjax/mask_grid.h).
      const cudaError_t mask_err =
          common::launch_mask_bits_tiles<Layouts::kBlockM, Layouts::kBlockN>(mask_bits_grid(params), stream);
      if (mask_err != cudaSuccess) return mask_err;
    }
    // Same condition as BwdScoreScales::has_softcap.
    const bool capped = params.softcap > 0.f;
    auto kernel = mask_mod ? (capped ? bwd_kernel_sm80<Layouts, true, true> : bwd_kernel_sm80<Layouts, false, true>)
                           : (capped ? bwd_kernel_sm80<Layouts, true, false> : bwd_kernel_sm80<Layouts, false, false>);
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layouts::kSmemBytes);
    if (err != cudaSuccess) return err;
    const dim3 grid = BwdBlockScheduler<Layouts::kBlockN, /*kKeys=*/true>::grid(params);
    if (grid.x == 0) return cudaErrorInvalidConfiguration;  // varlen's virtual blocks past INT_MAX
    kernel<<<grid, Layouts::kNThreads, Layouts::kSmemBytes, stream>>>(params);
  }

  if (params.seqlen_q > 0) {
    const dim3 grid = BwdBlockScheduler<Layouts::kBlockM, /*kKeys=*/false>::grid(params);
    if (grid.x == 0) return cudaErrorInvalidConfiguration;
    bwd_postprocess_kernel<Layouts><<<grid, Layouts::kNThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

// Declared in launch.h: the most dynamic shared memory any of run_bwd's launches requests (the main kernel; the
// preprocess and postprocess launch with none).
template <typename Element, int kHeadDim, int kSmemKB>
int bwd_smem_bytes() {
  constexpr int kSmemBytes = BwdLayouts<Element, kHeadDim, kSmemKB>::kSmemBytes;
  return kSmemBytes;
}

// Declared in launch.h: one tile configuration whatever the call (each CTA owns block_n keys and steps over
// block_m query rows): bwd_tile_sizes' for this head dim and budget.
template <typename Element, int kHeadDim, int kSmemKB>
FamilyChoices bwd_choices(const AttnShape&, const ChoiceQuery& query) {
  using Layouts = BwdLayouts<Element, kHeadDim, kSmemKB>;
  FamilyChoices choices;
  choices.block_m = Layouts::kBlockM;
  choices.block_n = Layouts::kBlockN;
  if (query.explain) {
    choices.tile_reason = std::to_string(choices.block_n) + " keys per CTA, " + std::to_string(choices.block_m) +
                          " query rows per step (the family's configuration for this head dim in " +
                          std::to_string(kSmemKB) + " KB of shared memory per block: " +
                          std::to_string(Layouts::kSmemBytes / 1024) + " KB" +
                          (Layouts::kVInRegs ? ", V in registers" : "") + ")";
  }
  return choices;
}

}  // namespace flashjax::sm80

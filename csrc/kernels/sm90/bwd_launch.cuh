// Host launcher of the sm90 backward: defines flashjax::sm90::run_bwd (declared in launch.h). Included by the
// generated instantiation files, one per (Element, head dim).
//
// Three launches on the caller's stream: the row pass shared with the portable family (D' = rowsum(dO∘O) - dlse, LSE
// in log2 units, dq_accum zeroed, dsinks; sm80/bwd_preprocess.cuh: plain CUDA, nothing sm80-specific), the main
// kernel (bwd_kernel.cuh) and the dQ conversion (bwd_postprocess.cuh); with deterministic=True also the counters'
// memset and, with sinks, the ordered dsinks sum. Nothing here synchronizes, allocates or reads device memory, so
// the call can be captured into a CUDA graph.
//
// Packed sequences (cu_seqlens_q set, docs/design.md §2.7): the same three passes with the varlen variants of the
// main kernel and the postprocess (grids over the virtual blocks of bwd_varlen_scheduler.cuh) and the workspace of
// bwd_varlen_workspace_layout (the row pass places each sequence's rows there itself: bwd_row_of_slab_row). dq, dk
// and dv are zeroed first, as the sm80 family does: the rows no CTA writes (past seqused, outside every sequence,
// rows malformed offsets leave out) are 0, as the reference gives unused rows. deterministic=True is refused with
// varlen (the counters are laid out per dense batch; dispatch never sends such a call here).
//
// A mask mod (mask_bits set; dense: dispatch refuses it with varlen): before the main kernel, the tile classes of the
// backward's tiles and each key block's query-block lists (common/mask_query_block_lists.cuh) into the mask
// workspace, then the kMaskMod variant of the main kernel, which walks them. With deterministic=True its dQ writer
// ranks the key blocks by those same classes (bwd_dq_order.cuh), so the turns count the steps the lists keep.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashjax/choices.h"
#include "flashjax/params.h"
#include "flashjax/workspace.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/mask_query_block_lists.cuh"
#include "kernels/common/varlen_gradients.h"
#include "kernels/sm80/bwd_preprocess.cuh"
#include "kernels/sm90/bwd_kernel.cuh"
#include "kernels/sm90/bwd_postprocess.cuh"
#include "kernels/sm90/bwd_tile_sizes.cuh"
#include "kernels/sm90/bwd_varlen_scheduler.cuh"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tma_compatible.h"

namespace flashjax::sm90 {

namespace detail {

template <typename Element, int kHeadDim, bool kSoftcap, bool kVarlen = false, bool kMaskMod = false>
using BwdKernelFor = BwdKernelSm90<Element, kHeadDim, kSoftcap, kVarlen, kMaskMod>;

template <typename Kernel>
cudaError_t launch_bwd_kernel(const BwdParams& params, cudaStream_t stream) {
  using Mainloop = typename Kernel::Mainloop;
  auto kernel = bwd_kernel_sm90<Kernel>;
  // Above 48 KB dynamic shared memory is opt-in per kernel (not a stream operation: legal during graph capture).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) return err;
  const typename Kernel::Params kernel_params{Mainloop::to_params(params), params};
  static_assert(sizeof(typename Kernel::Params) <= 4096, "kernel parameters over 4 KB");
  dim3 grid(common::ceil_div(params.seqlen_k, Mainloop::kBlockN), params.heads_k, params.batch);
  if constexpr (Kernel::kVarlen) {
    const int64_t blocks = Kernel::VarlenScheduler::num_blocks(params);
    if (blocks < 0) return cudaErrorInvalidConfiguration;  // virtual blocks past a grid's int
    if (blocks == 0) return cudaSuccess;
    grid = dim3(static_cast<unsigned>(blocks), params.heads_k, 1);
  }
  kernel<<<grid, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(kernel_params);
  return cudaGetLastError();
}

// The main kernel for the call's softcap and packing.
template <typename Element, int kHeadDim, bool kVarlen>
cudaError_t launch_bwd_main(const BwdParams& params, cudaStream_t stream) {
  return params.softcap > 0.f ? launch_bwd_kernel<BwdKernelFor<Element, kHeadDim, true, kVarlen>>(params, stream)
                              : launch_bwd_kernel<BwdKernelFor<Element, kHeadDim, false, kVarlen>>(params, stream);
}

// A mask mod's main kernel for the call's softcap, after the lists it walks (dense only).
template <typename Element, int kHeadDim>
cudaError_t launch_bwd_mask_mod(const BwdParams& params, cudaStream_t stream) {
  using Mainloop = typename BwdKernelFor<Element, kHeadDim, false, false, true>::Mainloop;
  const cudaError_t err = common::launch_mask_query_block_lists<Mainloop::kBlockM, Mainloop::kBlockN>(params, stream);
  if (err != cudaSuccess) return err;
  return params.softcap > 0.f
             ? launch_bwd_kernel<BwdKernelFor<Element, kHeadDim, true, false, true>>(params, stream)
             : launch_bwd_kernel<BwdKernelFor<Element, kHeadDim, false, false, true>>(params, stream);
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Uncapped = detail::BwdKernelFor<Element, kHeadDim, false>;
  using Mainloop = typename Uncapped::Mainloop;
  using RowPass = sm80::BwdRowPassShape;
  static_assert(kBwdVarlenRowBlock % Mainloop::kBlockM == 0, "varlen query blocks stay whole in a sequence's rows");
  const bool varlen = params.cu_seqlens_q != nullptr;
  // The workspace's rows per slab: Sq rounded, or varlen's per-sequence placement (flashjax/workspace.h).
  const int64_t slab_rows = varlen ? bwd_varlen_rows(params.seqlen_q, params.num_seqs)
                                   : int64_t(common::ceil_div(params.seqlen_q, kBwdSeqlenQRounding)) *
                                         kBwdSeqlenQRounding;
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0 ||
      params.seqlen_q < 0 || params.seqlen_k < 0 || params.batch < 0 || params.seqlen_q_rounded < slab_rows ||
      params.seqlen_q_rounded % kBwdSeqlenQRounding != 0 || kBwdSeqlenQRounding % Mainloop::kBlockM != 0 ||
      (varlen && (params.batch != 1 || params.num_seqs < 0 || params.deterministic))) {
    return cudaErrorInvalidValue;
  }
  // A mask mod: dense (dispatch sends no other); launch_bwd_mask_mod checks its workspace.
  const bool mask_mod = params.mask_bits != nullptr;
  if (mask_mod && varlen) return cudaErrorInvalidValue;
  if (!detail::tma_compatible<Element>(params.q, params.q_row_stride, params.q_head_stride, params.q_batch_stride) ||
      !detail::tma_compatible<Element>(params.k, params.k_row_stride, params.k_head_stride, params.k_batch_stride) ||
      !detail::tma_compatible<Element>(params.v, params.v_row_stride, params.v_head_stride, params.v_batch_stride) ||
      !detail::tma_compatible<Element>(params.dout, params.do_row_stride, params.do_head_stride,
                                       params.do_batch_stride)) {
    return cudaErrorInvalidValue;
  }
  if (params.deterministic && params.dq_semaphore == nullptr) return cudaErrorInvalidValue;
  // dsinks is accumulated by the preprocess (one atomic per block), so it starts from zero (the deterministic
  // pass below overwrites it, also where there are no rows).
  if (params.sinks != nullptr && params.heads_q > 0) {
    const cudaError_t err = cudaMemsetAsync(params.dsinks, 0, sizeof(float) * params.heads_q, stream);
    if (err != cudaSuccess) return err;
  }
  if (varlen) {
    if (const cudaError_t err = common::zero_varlen_gradients<Element>(params, stream); err != cudaSuccess) return err;
    if (params.num_seqs == 0) return cudaGetLastError();  // no sequence: zero gradients, dsinks 0
  }
  if (params.batch == 0 || params.heads_q == 0) return cudaGetLastError();
  if (params.deterministic) {
    const size_t counters = bwd_dq_semaphores(params.batch, params.heads_q, params.seqlen_q);
    const cudaError_t err = cudaMemsetAsync(params.dq_semaphore, 0, sizeof(int32_t) * counters, stream);
    if (err != cudaSuccess) return err;
  }

  // The preprocess covers every padded row: the main kernel reads lse_log2 / dpsum and adds into dq_accum there.
  if (params.seqlen_q_rounded > 0) {
    const dim3 grid(params.seqlen_q_rounded / RowPass::kRowsPerBlock, params.heads_q, params.batch);
    sm80::bwd_preprocess_kernel<Element, kHeadDim><<<grid, RowPass::kThreads, 0, stream>>>(params);
    if (params.deterministic && params.sinks != nullptr) {
      sm80::bwd_dsinks_ordered_kernel<><<<params.heads_q, RowPass::kThreads, 0, stream>>>(params);
    }
  }
  // With Sq = 0 the main kernel still runs: its CTAs run no step and write zero dK / dV.
  if (params.seqlen_k > 0) {
    const cudaError_t err = varlen     ? detail::launch_bwd_main<Element, kHeadDim, true>(params, stream)
                            : mask_mod ? detail::launch_bwd_mask_mod<Element, kHeadDim>(params, stream)
                                       : detail::launch_bwd_main<Element, kHeadDim, false>(params, stream);
    if (err != cudaSuccess) return err;
  }
  if (params.seqlen_q > 0 && !varlen) {
    const dim3 grid(common::ceil_div(params.seqlen_q, Mainloop::kBlockM), params.heads_q, params.batch);
    bwd_postprocess_kernel_sm90<Mainloop><<<grid, Mainloop::kMmaThreads, 0, stream>>>(params);
  } else if (params.seqlen_q > 0) {
    const int64_t blocks = BwdVarlenSchedulerSm90<Mainloop::kBlockM, /*kKeys=*/false>::num_blocks(params);
    if (blocks < 0) return cudaErrorInvalidConfiguration;
    const dim3 grid(static_cast<unsigned>(blocks), params.heads_q, 1);
    bwd_postprocess_kernel_sm90<Mainloop, true><<<grid, Mainloop::kMmaThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

// Declared in launch.h: the main kernel's shared memory (the capped and uncapped kernels share their storage; the
// row passes launch with none).
template <typename Element, int kHeadDim>
int bwd_smem_bytes() {
  constexpr int kSmemBytes = detail::BwdKernelFor<Element, kHeadDim, false>::kSmemBytes;
  return kSmemBytes;
}

// Declared in launch.h: one tile configuration per head dim (bwd_tile_sizes.cuh).
template <typename Element, int kHeadDim>
FamilyChoices bwd_choices(const AttnShape&, const ChoiceQuery& query) {
  constexpr BwdTileSizes kTiles = bwd_tile_sizes(kHeadDim);
  FamilyChoices choices;
  choices.block_m = kTiles.block_m;
  choices.block_n = kTiles.block_n;
  // A mask mod's kernel walks per-key-block lists of query blocks, built from the classes of these same tiles.
  if (query.mask_mod) choices.mask_block_lists = MaskBlockLists::kQueryBlocks;
  if (query.explain) {
    const char* split = kTiles.split == BwdWarpgroupSplit::kByKeys
                            ? " keys per CTA (two MMA warpgroups of 64), "
                            : " keys per CTA (two MMA warpgroups, each dK / dV for half of the head dim), ";
    choices.tile_reason = std::to_string(kTiles.block_n) + split + std::to_string(kTiles.block_m) +
                          " query rows per step (bwd_tile_sizes for head dim " + std::to_string(kHeadDim) + ")" +
                        (query.mask_mod ? "; mask mod: each key block walks its list of query blocks, the mod's "
                                          "empty tiles left out, its full ones run without the bits"
                                        : "");
  }
  return choices;
}

}  // namespace flashjax::sm90

// Host launcher of the sm90 backward: defines flashjax::sm90::run_bwd (declared in launch.h). Included by the
// generated instantiation files, one per (Element, head dim).
//
// Three launches on the caller's stream: the row pass shared with the portable family (D' = rowsum(dO∘O) - dlse, LSE
// in log2 units, dq_accum zeroed, dsinks; sm80/bwd_preprocess.cuh: plain CUDA, nothing sm80-specific), the main
// kernel (bwd_kernel.cuh) and the dQ conversion (bwd_postprocess.cuh); with deterministic=True also the counters'
// memset and, with sinks, the ordered dsinks sum. Nothing here synchronizes, allocates or reads device memory, so
// the call can be captured into a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashjax/choices.h"
#include "flashjax/params.h"
#include "flashjax/workspace.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/sm80/bwd_preprocess.cuh"
#include "kernels/sm90/bwd_kernel.cuh"
#include "kernels/sm90/bwd_postprocess.cuh"
#include "kernels/sm90/bwd_tile_sizes.cuh"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tma_compatible.h"

namespace flashjax::sm90 {

namespace detail {

template <typename Element, int kHeadDim, bool kSoftcap>
using BwdKernelFor = BwdKernelSm90<Element, kHeadDim, kSoftcap>;

template <typename Kernel>
cudaError_t launch_bwd_kernel(const BwdParams& params, cudaStream_t stream) {
  using Mainloop = typename Kernel::Mainloop;
  auto kernel = bwd_kernel_sm90<Kernel>;
  // Above 48 KB dynamic shared memory is opt-in per kernel (not a stream operation: legal during graph capture).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) return err;
  const typename Kernel::Params kernel_params{Mainloop::to_params(params), params};
  static_assert(sizeof(typename Kernel::Params) <= 4096, "kernel parameters over 4 KB");
  const dim3 grid(common::ceil_div(params.seqlen_k, Mainloop::kBlockN), params.heads_k, params.batch);
  kernel<<<grid, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(kernel_params);
  return cudaGetLastError();
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Uncapped = detail::BwdKernelFor<Element, kHeadDim, false>;
  using Capped = detail::BwdKernelFor<Element, kHeadDim, true>;
  using Mainloop = typename Uncapped::Mainloop;
  using RowPass = sm80::BwdRowPassShape;
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0 ||
      params.seqlen_q < 0 || params.seqlen_k < 0 || params.batch < 0 ||
      params.seqlen_q_rounded < common::ceil_div(params.seqlen_q, kBwdSeqlenQRounding) * kBwdSeqlenQRounding ||
      params.seqlen_q_rounded % kBwdSeqlenQRounding != 0 || kBwdSeqlenQRounding % Mainloop::kBlockM != 0 ||
      params.mask_bits != nullptr) {  // mask mods run on the sm80 family (dispatch sends them there)
    return cudaErrorInvalidValue;
  }
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
    const cudaError_t err = params.softcap > 0.f ? detail::launch_bwd_kernel<Capped>(params, stream)
                                                 : detail::launch_bwd_kernel<Uncapped>(params, stream);
    if (err != cudaSuccess) return err;
  }
  if (params.seqlen_q > 0) {
    const dim3 grid(common::ceil_div(params.seqlen_q, Mainloop::kBlockM), params.heads_q, params.batch);
    bwd_postprocess_kernel_sm90<Mainloop><<<grid, Mainloop::kMmaThreads, 0, stream>>>(params);
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
  if (query.explain) {
    const char* split = kTiles.split == BwdWarpgroupSplit::kByKeys
                            ? " keys per CTA (two MMA warpgroups of 64), "
                            : " keys per CTA (two MMA warpgroups, each dK / dV for half of the head dim), ";
    choices.tile_reason = std::to_string(kTiles.block_n) + split + std::to_string(kTiles.block_m) +
                          " query rows per step (bwd_tile_sizes for head dim " + std::to_string(kHeadDim) + ")";
  }
  return choices;
}

}  // namespace flashjax::sm90

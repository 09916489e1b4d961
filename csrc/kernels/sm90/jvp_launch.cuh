// Host launcher of the sm90 fused jvp kernel: defines flashjax::sm90::run_jvp, jvp_smem_bytes and jvp_choices
// (declared in launch.h). Included by the generated instantiation files, one per (Element, head dim <= 128). Builds
// the TMA descriptors (the tangent mainloop's for the inputs, the epilogue's stores for out and t_out) and launches
// one CTA per 128-row query tile; never synchronizes, allocates or reads device memory.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "flashjax/choices.h"
#include "flashjax/params.h"
#include "kernels/sm90/jvp_kernel.cuh"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tma_compatible.h"

namespace flashjax::sm90 {

namespace detail {

template <typename Kernel>
cudaError_t launch_jvp_kernel(const JvpParams& params, cudaStream_t stream) {
  using Mainloop = typename Kernel::Mainloop;
  using Element = typename Mainloop::Element;
  constexpr int kHeadDim = Mainloop::kHeadDim;
  const int64_t num_ctas = Kernel::Scheduler::num_ctas(params);
  if (num_ctas == 0) return cudaSuccess;  // Sq = 0, B = 0 or Hq = 0: nothing to write
  if (num_ctas > INT_MAX) return cudaErrorInvalidConfiguration;
  // Each tangent is read and written with its primal's strides (params.h); every pointer must suit TMA on its own.
  if (!tma_compatible<Element>(params.q, params.q_row_stride, params.q_head_stride, params.q_batch_stride) ||
      !tma_compatible<Element>(params.tq, params.q_row_stride, params.q_head_stride, params.q_batch_stride) ||
      !tma_compatible<Element>(params.k, params.k_row_stride, params.k_head_stride, params.k_batch_stride) ||
      !tma_compatible<Element>(params.tk, params.k_row_stride, params.k_head_stride, params.k_batch_stride) ||
      !tma_compatible<Element>(params.v, params.v_row_stride, params.v_head_stride, params.v_batch_stride) ||
      !tma_compatible<Element>(params.tv, params.v_row_stride, params.v_head_stride, params.v_batch_stride) ||
      !tma_compatible<Element>(params.o, params.o_row_stride, params.o_head_stride, params.o_batch_stride) ||
      !tma_compatible<Element>(params.t_out, params.o_row_stride, params.o_head_stride, params.o_batch_stride)) {
    return cudaErrorInvalidValue;
  }
  // A TMA dimension cannot be 0: with Sk = 0 every tile is empty (the band has no key) and K/V are never loaded.
  const int seqlen_k_tma = params.seqlen_k > 0 ? params.seqlen_k : 1;
  const typename Mainloop::Arguments mainloop_args{
      static_cast<const Element*>(params.q),
      static_cast<const Element*>(params.k),
      static_cast<const Element*>(params.v),
      static_cast<const Element*>(params.tq),
      static_cast<const Element*>(params.tk),
      static_cast<const Element*>(params.tv),
      {params.seqlen_q, kHeadDim, params.heads_q, params.batch},
      {seqlen_k_tma, kHeadDim, params.heads_k, params.batch},
      {params.q_row_stride, cute::_1{}, params.q_head_stride, params.q_batch_stride},
      {params.k_row_stride, cute::_1{}, params.k_head_stride, params.k_batch_stride},
      {params.v_row_stride, cute::_1{}, params.v_head_stride, params.v_batch_stride}};
  const typename Kernel::Params kernel_params{Mainloop::to_params(mainloop_args), Kernel::Epilogue::to_params(params),
                                              static_cast<const AttnShape&>(params),
                                              params.heads_q / params.heads_k};
  static_assert(sizeof(typename Kernel::Params) <= 4096, "kernel parameters over 4 KB");
  auto kernel = jvp_kernel_sm90<Kernel>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(num_ctas), Kernel::kThreads, Kernel::kSmemBytes, stream>>>(kernel_params);
  return cudaGetLastError();
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_jvp(const JvpParams& params, cudaStream_t stream) {
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0 ||
      (params.sinks != nullptr) != (params.tsinks != nullptr)) {
    return cudaErrorInvalidValue;
  }
  // Dense calls only: dispatch never gives varlen or mask-mod calls to this kernel (gen_kernels.py's VARLEN, MASK_MOD).
  if (params.cu_seqlens_q != nullptr || params.mask_bits != nullptr) return cudaErrorInvalidValue;
  return params.softcap > 0.f ? detail::launch_jvp_kernel<JvpKernelSm90<Element, kHeadDim, true>>(params, stream)
                              : detail::launch_jvp_kernel<JvpKernelSm90<Element, kHeadDim, false>>(params, stream);
}

// Declared in launch.h: the dynamic shared memory run_jvp launches with (both softcap twins share the storage).
template <typename Element, int kHeadDim>
int jvp_smem_bytes() {
  return JvpKernelSm90<Element, kHeadDim, false>::kSmemBytes;
}

// Declared in launch.h: one tile configuration whatever the call (jvp_tile_sizes.cuh).
template <typename Element, int kHeadDim>
FamilyChoices jvp_choices(const AttnShape&, const ChoiceQuery& query) {
  constexpr TangentTileSizes kTile = jvp_tile_sizes(kHeadDim);
  FamilyChoices choices;
  choices.block_m = kTile.block_m;
  choices.block_n = kTile.block_n;
  if (query.explain) {
    choices.tile_reason = std::to_string(kTile.block_m) + " x " + std::to_string(kTile.block_n) +
                          " tiles (the sm90 fused jvp's configuration for this head dim: two consumer warpgroups of "
                          "64 rows holding O and its tangent, " + std::to_string(kTile.stages_k) + " (K, tK) and " +
                          std::to_string(kTile.stages_v) + " (V, tV) stages, " +
                          std::to_string(jvp_smem_bytes<Element, kHeadDim>() / 1024) +
                          " KB of shared memory per block)";
  }
  return choices;
}

}  // namespace flashjax::sm90

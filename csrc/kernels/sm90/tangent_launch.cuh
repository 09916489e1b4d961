// Host launcher of the sm90 tangent kernel: defines flashjax::sm90::run_tangent, tangent_smem_bytes and
// tangent_choices (declared in launch.h). Included by the generated instantiation files, one per (Element, head dim).
// Builds the TMA descriptors (host-side encoding), launches one CTA per 128-row query tile (a mask mod: after listing
// each tile's blocks); never synchronizes, allocates or reads device memory.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "flashjax/choices.h"
#include "flashjax/params.h"
#include "kernels/common/mask_block_lists.cuh"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tangent_kernel.cuh"
#include "kernels/sm90/tma_compatible.h"

namespace flashjax::sm90 {

namespace detail {

// The launch the tangent and the fused jvp (jvp_launch.cuh) share: both read q, k, v and their tangents through the
// tangent mainloop's TMA loads and write t_out in o's layout, from TangentParams or JvpParams (the same fields; o is
// the tangent's input, the jvp's output). kernel: the __global__ function; kernel_params_of(dense): Kernel::Params
// from the dense ones (TangentCtaSm90::DenseParams).
template <typename Kernel, typename Params, typename KernelFn, typename KernelParamsOf>
cudaError_t launch_tangent_cta(KernelFn kernel, const Params& params, cudaStream_t stream,
                               KernelParamsOf kernel_params_of) {
  using Mainloop = typename Kernel::Mainloop;
  using Element = typename Mainloop::Element;
  constexpr int kHeadDim = Mainloop::kHeadDim;
  const int64_t num_ctas = Kernel::Scheduler::num_ctas(params);
  if (num_ctas == 0) return cudaSuccess;  // Sq = 0, B = 0 or Hq = 0: nothing to write
  if (num_ctas > INT_MAX) return cudaErrorInvalidConfiguration;
  // Each tangent is read or written with its primal's strides (params.h); every pointer must suit TMA on its own.
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
  const typename Kernel::DenseParams dense_params{Mainloop::to_params(mainloop_args),
                                                  Kernel::Epilogue::to_params(params),
                                                  static_cast<const AttnShape&>(params),
                                                  params.heads_q / params.heads_k};
  const typename Kernel::Params kernel_params = kernel_params_of(dense_params);
  static_assert(sizeof(typename Kernel::Params) <= 4096, "kernel parameters over 4 KB");
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) return err;
  // Neither kernel has griddepcontrol.wait: launched without programmatic dependent launch, it starts only once the
  // stream's previous kernel (the tangent's: the forward that wrote o and lse) has finished.
  kernel<<<static_cast<unsigned>(num_ctas), Kernel::kThreads, Kernel::kSmemBytes, stream>>>(kernel_params);
  return cudaGetLastError();
}

template <typename Kernel>
cudaError_t launch_tangent_kernel(const TangentParams& params, cudaStream_t stream) {
  return launch_tangent_cta<Kernel>(
      tangent_kernel_sm90<Kernel>, params, stream,
      [&](const typename Kernel::DenseParams& dense_params) -> typename Kernel::Params {
        if constexpr (Kernel::kMaskMod) {  // the bits and the block lists, read per tile
          return {dense_params, common::MaskModTiles::of<Kernel::kBlockM, Kernel::kBlockN>(params)};
        } else {
          return dense_params;
        }
      });
}

// The checks run_tangent and run_jvp begin with: the instantiation's head dim, whole GQA groups, and the sinks with
// their tangent, both or neither.
template <int kHeadDim, typename Params>
bool tangent_call_fits(const Params& params) {
  return params.head_dim == kHeadDim && params.heads_k > 0 && params.heads_q % params.heads_k == 0 &&
         (params.sinks != nullptr) == (params.tsinks != nullptr);
}

// The one tile configuration of tangent_choices and jvp_choices; `kernel` says whose it is in the explanation.
inline FamilyChoices tangent_tile_choices(const TangentTileSizes& tile, int smem_bytes, bool explain,
                                          const char* kernel) {
  FamilyChoices choices;
  choices.block_m = tile.block_m;
  choices.block_n = tile.block_n;
  if (explain) {
    choices.tile_reason = std::to_string(tile.block_m) + " x " + std::to_string(tile.block_n) + " tiles (" + kernel +
                          ", " + std::to_string(tile.stages_k) + " (K, tK) and " + std::to_string(tile.stages_v) +
                          " (V, tV) stages, " + std::to_string(smem_bytes / 1024) + " KB of shared memory per block)";
  }
  return choices;
}

// A mask mod: the tile classes and block lists for the tangent's own tiles (kernels/common/mask_block_lists.cuh, into
// the workspace the plan sized with tangent_choices' tiles), then the kMaskMod kernel; all on `stream`.
template <typename Element, int kHeadDim>
cudaError_t launch_tangent_mask_mod(const TangentParams& params, cudaStream_t stream) {
  using Dense = TangentKernelSm90<Element, kHeadDim, false>;
  if (params.mask_tile_classes == nullptr || params.mask_block_lists == nullptr) return cudaErrorInvalidValue;
  if (Dense::Scheduler::num_ctas(params) == 0) return cudaSuccess;  // no tile: nothing to list or write
  const cudaError_t err = common::launch_mask_block_lists<Dense::kBlockM, Dense::kBlockN>(params, stream);
  if (err != cudaSuccess) return err;
  return params.softcap > 0.f
             ? launch_tangent_kernel<TangentKernelSm90<Element, kHeadDim, true, true>>(params, stream)
             : launch_tangent_kernel<TangentKernelSm90<Element, kHeadDim, false, true>>(params, stream);
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_tangent(const TangentParams& params, cudaStream_t stream) {
  if (!detail::tangent_call_fits<kHeadDim>(params)) return cudaErrorInvalidValue;
  // Dense calls only (gen_kernels.py's VARLEN keeps varlen tangents on the sm80 family).
  if (params.cu_seqlens_q != nullptr) return cudaErrorInvalidValue;
  if (params.mask_bits != nullptr) return detail::launch_tangent_mask_mod<Element, kHeadDim>(params, stream);
  return params.softcap > 0.f
             ? detail::launch_tangent_kernel<TangentKernelSm90<Element, kHeadDim, true>>(params, stream)
             : detail::launch_tangent_kernel<TangentKernelSm90<Element, kHeadDim, false>>(params, stream);
}

// Declared in launch.h: the dynamic shared memory run_tangent launches with (both softcap twins share the storage).
template <typename Element, int kHeadDim>
int tangent_smem_bytes() {
  return TangentKernelSm90<Element, kHeadDim, false>::kSmemBytes;
}

// Declared in launch.h: one tile configuration whatever the call (tangent_tile_sizes.cuh).
template <typename Element, int kHeadDim>
FamilyChoices tangent_choices(const AttnShape&, const ChoiceQuery& query) {
  FamilyChoices choices = detail::tangent_tile_choices(
      tangent_tile_sizes(kHeadDim), tangent_smem_bytes<Element, kHeadDim>(), query.explain,
      "the sm90 tangent's configuration for this head dim: two consumer warpgroups of 64 rows");
  // A mask mod's tangent walks block lists for these tiles (launch_tangent_mask_mod): the workspace holds them.
  choices.mask_block_lists = query.mask_mod ? MaskBlockLists::kKeyBlocks : MaskBlockLists::kNone;
  return choices;
}

}  // namespace flashjax::sm90

// Host launcher of the sm90 fused jvp kernel: defines flashjax::sm90::run_jvp, jvp_smem_bytes and jvp_choices
// (declared in launch.h). Included by the generated instantiation files, one per (Element, head dim <= 128). Builds
// the TMA descriptors (the tangent mainloop's for the inputs, the epilogue's stores for out and t_out) and launches
// one CTA per 128-row query tile; never synchronizes, allocates or reads device memory.
#pragma once

#include <cuda_runtime.h>

#include "flashjax/choices.h"
#include "flashjax/params.h"
#include "kernels/sm90/jvp_kernel.cuh"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tangent_launch.cuh"

namespace flashjax::sm90 {

namespace detail {

template <typename Kernel>
cudaError_t launch_jvp_kernel(const JvpParams& params, cudaStream_t stream) {
  // The tangent's launch (tangent_launch.cuh); the kernel's parameters are the dense ones.
  return launch_tangent_cta<Kernel>(jvp_kernel_sm90<Kernel>, params, stream,
                                    [](const typename Kernel::Params& dense_params) { return dense_params; });
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_jvp(const JvpParams& params, cudaStream_t stream) {
  if (!detail::tangent_call_fits<kHeadDim>(params)) return cudaErrorInvalidValue;
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
  return detail::tangent_tile_choices(jvp_tile_sizes(kHeadDim), jvp_smem_bytes<Element, kHeadDim>(), query.explain,
                                      "the sm90 fused jvp's configuration for this head dim: two consumer warpgroups "
                                      "of 64 rows holding O and its tangent");
}

}  // namespace flashjax::sm90

#include "ffi/kernel_table.h"

#include <cutlass/numeric_types.h>

#include "kernels/sm80/launch.h"

namespace flashjax {
namespace {

template <typename Params>
using LaunchFn = cudaError_t (*)(const Params&, cudaStream_t);

}  // namespace

const std::vector<KernelEntry>& kernel_table() {
  // Each row names an explicit instantiation compiled from csrc/kernels/generated/.
#define FLASHJAX_KERNEL(family, run, direction, params, dtype, element, hdim) \
  KernelEntry{#family, direction, dtype, hdim,                                  \
              reinterpret_cast<const void*>(static_cast<LaunchFn<params>>(&family::run<element, hdim>))},
  static const std::vector<KernelEntry> table = {
#if FLASHJAX_KERNEL_SET_CI
#include "kernels/generated/kernel_table_ci.inc"
#elif FLASHJAX_KERNEL_SET_NONE
#else
#include "kernels/generated/kernel_table_full.inc"
#endif
  };
#undef FLASHJAX_KERNEL
  return table;
}

const std::vector<std::string>& compiled_archs() {
  static const std::vector<std::string> archs = split_archs(FLASHJAX_CUDA_ARCHS);
  return archs;
}

}  // namespace flashjax

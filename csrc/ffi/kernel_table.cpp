#include "ffi/kernel_table.h"

#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cstdlib>

#include "kernels/sm80/launch.h"
#if FLASHJAX_HAS_SM90
#include "kernels/sm90/launch.h"
#endif

namespace flashjax {
namespace {

template <typename Params>
using LaunchFn = cudaError_t (*)(const Params&, cudaStream_t);

}  // namespace

const std::vector<KernelEntry>& kernel_table() {
  // Each row names explicit instantiations compiled from csrc/kernels/generated/: the launcher, and the function
  // that reports the dynamic shared memory per block its launches request, asked once here when the table is built
  // (the figure comes from the kernel's own types; dispatch stays a pure function of the rows).
#define FLASHJAX_KERNEL(family, run, direction, params, dtype, element, hdim, arch_specific, smem_bytes)   \
  KernelEntry{#family, direction, dtype, hdim, arch_specific, family::smem_bytes<element, hdim>(),        \
              reinterpret_cast<const void*>(static_cast<LaunchFn<params>>(&family::run<element, hdim>))},
  static const std::vector<KernelEntry> table = {
#if FLASHJAX_KERNEL_SET_CI
#include "kernels/generated/kernel_table_ci.inc"
#elif FLASHJAX_KERNEL_SET_BENCH
#include "kernels/generated/kernel_table_bench.inc"
#elif FLASHJAX_KERNEL_SET_NONE
#else
#include "kernels/generated/kernel_table_full.inc"
#endif
  };
#undef FLASHJAX_KERNEL
  return table;
}

const std::vector<KernelEntry>& enabled_kernel_table() {
  static const std::vector<KernelEntry> enabled = [] {
    const char* env = std::getenv("FLASHJAX_DISABLE_FAMILIES");
    const std::vector<std::string> disabled = split_archs(env != nullptr ? env : "");
    std::vector<KernelEntry> rows;
    for (const KernelEntry& entry : kernel_table()) {
      if (std::find(disabled.begin(), disabled.end(), entry.family) == disabled.end()) rows.push_back(entry);
    }
    return rows;
  }();
  return enabled;
}

const std::vector<std::string>& compiled_archs() {
  static const std::vector<std::string> archs = split_archs(FLASHJAX_CUDA_ARCHS);
  return archs;
}

}  // namespace flashjax

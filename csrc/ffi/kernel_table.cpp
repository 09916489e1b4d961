#include "ffi/kernel_table.h"

#include <cutlass/numeric_types.h>

#include <algorithm>

#include "flashjax/settings.h"

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
  // Each row names explicit instantiations compiled from csrc/kernels/generated/: the launcher, the function that
  // reports the dynamic shared memory per block its launches request (asked once here when the table is built: the
  // figure comes from the kernel's own types, and dispatch stays a pure function of the rows), and the family's
  // per-call choices (asked by the plan).
#define FLASHJAX_KERNEL(family, run, direction, params, dtype, element, hdim, arch_specific, smem_bytes, choices, \
                        deterministic)                                                                         \
  KernelEntry{#family,                                                                                         \
              direction,                                                                                       \
              dtype,                                                                                           \
              hdim,                                                                                            \
              arch_specific,                                                                                   \
              family::smem_bytes<element, hdim>(),                                                             \
              reinterpret_cast<const void*>(static_cast<LaunchFn<params>>(&family::run<element, hdim>)),        \
              &family::choices<element, hdim>,                                                                 \
              deterministic},
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
    const std::vector<std::string> disabled = split_archs(setting_text(Setting::kDisableFamilies));
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

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
  // per-call choices (asked by the plan). targs is the instantiation's template argument list in parentheses,
  // e.g. (cutlass::bfloat16_t, 128, 99): the element type, the head dim, and the shared-memory budget of a family
  // that has budgets (sm80: launch.h).
#define FLASHJAX_KERNEL(family, run, direction, params, dtype, targs, hdim, arch_specific, smem_bytes, choices,    \
                        deterministic, varlen, mask_mod, varlen_mask_mod)                                      \
  FLASHJAX_KERNEL_ENTRY(family, direction, dtype, targs, hdim, arch_specific, smem_bytes, choices, deterministic, \
                        varlen, mask_mod, varlen_mask_mod,                                                     \
                        reinterpret_cast<const void*>(                                                         \
                            static_cast<LaunchFn<params>>(&family::run<FLASHJAX_TEMPLATE_ARGS targs>)))
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

int32_t dispatch_smem_limit(int device_sm, int32_t device_limit) {
  if (device_limit <= 0) device_limit = max_smem_per_block_optin(device_sm);
  const int cap_kb = setting_int(Setting::kSmemLimitKb, 0);
  return cap_kb > 0 ? std::min<int64_t>(device_limit, int64_t(cap_kb) * 1024) : device_limit;
}

const std::vector<std::string>& compiled_archs() {
  static const std::vector<std::string> archs = split_archs(FLASHJAX_CUDA_ARCHS);
  return archs;
}

}  // namespace flashjax

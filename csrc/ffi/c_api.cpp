// Plain C entry points that Python reads through ctypes, with no GPU needed: build information and the
// dispatch decision (so that flashjax.explain and backend="auto" use the one function the handlers use).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "ffi/dispatch.h"
#include "ffi/kernel_table.h"
#include "flashjax/workspace.h"
#include "kernels/sm90/fwd_pack_gqa.h"
#include "kernels/sm90/fwd_split_kv.h"

#define FLASHJAX_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

const char* dtype_json(flashjax::DType d) { return d == flashjax::DType::kFloat16 ? "fp16" : "bf16"; }

std::string build_info_json() {
  std::string archs, kernels;
  for (const std::string& a : flashjax::compiled_archs()) archs += (archs.empty() ? "\"" : ", \"") + a + "\"";
  for (const flashjax::KernelEntry& e : flashjax::kernel_table()) {
    kernels += std::string(kernels.empty() ? "" : ", ") + "{\"family\": \"" + e.family + "\", \"direction\": \"" +
               (e.direction == flashjax::Direction::kFwd ? "fwd" : "bwd") + "\", \"dtype\": \"" +
               dtype_json(e.dtype) + "\", \"head_dim\": " + std::to_string(e.head_dim) +
               ", \"smem_bytes\": " + std::to_string(e.smem_bytes) + "}";
  }
  return std::string("{\"version\": \"") + FLASHJAX_VERSION + "\", \"kernel_set\": \"" + FLASHJAX_KERNEL_SET +
         "\", \"cuda_archs\": [" + archs + "], \"cuda_version\": " + std::to_string(CUDART_VERSION) +
         ", \"bwd_seqlen_q_rounding\": " + std::to_string(flashjax::kBwdSeqlenQRounding) + ", \"kernels\": [" +
         kernels + "]}";
}

}  // namespace

// JSON describing this build; the string lives as long as the library.
FLASHJAX_EXPORT const char* flashjax_build_info() {
  static const std::string info = build_info_json();
  return info.c_str();
}

// Returns the kernel table index chosen for the call, or -1; writes the reason (NUL-terminated, truncated to
// reason_len) either way.
FLASHJAX_EXPORT int flashjax_choose_kernel(int device_sm, int direction, int dtype, int head_dim, int varlen,
                                           int mask_mod, char* reason, int reason_len) {
  flashjax::ProblemKey key;
  key.direction = static_cast<flashjax::Direction>(direction);
  key.dtype = static_cast<flashjax::DType>(dtype);
  key.head_dim = head_dim;
  key.varlen = varlen != 0;
  key.mask_mod = mask_mod != 0;
  const auto& table = flashjax::enabled_kernel_table();
  const flashjax::Choice choice = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key, table);
  if (reason != nullptr && reason_len > 0) {
    const size_t n = std::min(choice.reason.size(), static_cast<size_t>(reason_len - 1));
    std::memcpy(reason, choice.reason.data(), n);
    reason[n] = '\0';
  }
  return choice.kernel == nullptr ? -1 : static_cast<int>(choice.kernel - table.data());
}

// The family ("sm80", "sm90") of the kernel table row flashjax_choose_kernel returned, or "" for an index outside
// the table (e.g. its -1): so that callers never parse the reason to learn which family runs.
FLASHJAX_EXPORT const char* flashjax_kernel_family(int index) {
  const auto& table = flashjax::enabled_kernel_table();
  return index >= 0 && index < static_cast<int>(table.size()) ? table[index].family : "";
}

// The dynamic shared memory per block (bytes) dispatch allows a kernel on a device of compute capability
// `device_sm` when it answers flashjax_choose_kernel: its table of known archs (see dispatch.h).
FLASHJAX_EXPORT int flashjax_max_smem_per_block_optin(int device_sm) {
  return flashjax::max_smem_per_block_optin(device_sm);
}

// The compiled head width a call of head dim `head_dim` is zero-padded to; 0 when none holds it.
FLASHJAX_EXPORT int flashjax_padded_head_dim(int head_dim) { return flashjax::padded_head_dim(head_dim); }

// Query heads per tile of the sm90 forward for a call of these sizes (fwd_pack_gqa.h, FLASHJAX_SM90_PACK_GQA
// honoured): Hq / Hk where it packs GQA, 1 where it does not.
FLASHJAX_EXPORT int flashjax_sm90_fwd_pack_group(int seqlen_q, int heads_q, int heads_k) {
  return flashjax::sm90::fwd_pack_group(seqlen_q, heads_q, heads_k, flashjax::sm90::pack_gqa_mode());
}

// Parts per tile the sm90 forward splits a call's keys into on a GPU of num_sms SMs (fwd_split_kv.h,
// FLASHJAX_SM90_SPLIT_KV honoured): 1 where it does not split. head_dim is the compiled width. softcap (nonzero
// when the call is capped) no longer changes the answer since the split kernel got its capped twin; the parameter
// stays so that the entry keeps the signature Python's _ffi declares. Python lowers a call with more than one part
// to the split target with its workspace.
FLASHJAX_EXPORT int flashjax_sm90_fwd_num_splits(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_k,
                                                 int head_dim, int window_left, int /*softcap*/, int num_sms) {
  return flashjax::sm90::fwd_num_splits(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, window_left, num_sms,
                                        flashjax::sm90::split_kv_mode());
}

// Plain C entry points that Python reads through ctypes, with no GPU needed: the build information and the plan of a
// call (plan.h), the one function the FFI handlers also ask, so that backend="auto", the lowering, flashjax.explain
// and `python -m flashjax` see exactly the decisions the handlers make.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "ffi/dispatch.h"
#include "ffi/kernel_table.h"
#include "ffi/plan.h"
#include "flashjax/settings.h"
#include "flashjax/workspace.h"

#define FLASHJAX_EXPORT extern "C" __attribute__((visibility("default")))

// The problem and device as Python passes them (python/flashjax/_ffi.py mirrors both with ctypes). struct_size is
// the caller's sizeof, so that a mismatched pair of library and package fails instead of reading garbage.
struct flashjax_problem {
  int32_t struct_size;
  int32_t dtype;  // flashjax::DType
  int32_t batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim;
  int32_t window_left, window_right;
  float softcap;
  int32_t has_sinks, varlen, mask_mod, deterministic;
  int32_t num_splits;  // 0: the plan chooses
  int32_t mask_seqlen_q, mask_seqlen_k;  // varlen with a mask mod: the max_seqlen hints of its bits (plan.h)
};

struct flashjax_device {
  int32_t struct_size;
  int32_t sm;                    // compute capability, major * 10 + minor
  int32_t smem_per_block_optin;  // 0: by the table
  int32_t num_sms;               // 0: unknown
};

namespace {

const char* dtype_json(flashjax::DType d) { return d == flashjax::DType::kFloat16 ? "fp16" : "bf16"; }

std::string quoted(const char* text) {
  std::string out = "\"";
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c == '"' || *c == '\\') out += '\\';
    out += *c;
  }
  return out + "\"";
}

std::string build_info_json() {
  std::string archs, kernels, settings;
  for (const std::string& a : flashjax::compiled_archs()) archs += (archs.empty() ? "\"" : ", \"") + a + "\"";
  for (const flashjax::KernelEntry& e : flashjax::kernel_table()) {
    kernels += std::string(kernels.empty() ? "" : ", ") + "{\"family\": \"" + e.family + "\", \"direction\": \"" +
               (e.direction == flashjax::Direction::kFwd   ? "fwd"
                : e.direction == flashjax::Direction::kBwd ? "bwd"
                : e.direction == flashjax::Direction::kJvp ? "jvp"
                                                           : "tangent") + "\", \"dtype\": \"" +
               dtype_json(e.dtype) + "\", \"head_dim\": " + std::to_string(e.head_dim) +
               ", \"smem_bytes\": " + std::to_string(e.smem_bytes) +
               ", \"arch_specific\": " + (e.arch_specific ? "true" : "false") +
               ", \"deterministic\": " + (e.deterministic ? "true" : "false") +
               ", \"varlen\": " + (e.varlen ? "true" : "false") +
               ", \"mask_mod\": " + (e.mask_mod ? "true" : "false") + "}";
  }
  for (const flashjax::SettingInfo& s : flashjax::kSettings) {
    settings += std::string(settings.empty() ? "" : ", ") + "{\"name\": " + quoted(s.name) +
                ", \"value\": " + quoted(flashjax::setting_text(s.setting).c_str()) +
                ", \"meaning\": " + quoted(s.meaning) + "}";
  }
  return std::string("{\"version\": \"") + FLASHJAX_VERSION + "\", \"kernel_set\": \"" + FLASHJAX_KERNEL_SET +
         "\", \"cuda_archs\": [" + archs + "], \"cuda_version\": " + std::to_string(CUDART_VERSION) +
         ", \"kernels\": [" + kernels + "], \"settings\": [" + settings + "]}";
}

}  // namespace

// JSON describing this build; the string lives as long as the library.
FLASHJAX_EXPORT const char* flashjax_build_info() {
  static const std::string info = build_info_json();
  return info.c_str();
}

// The plan of a call (flashjax::plan_call) as JSON, written to json (NUL-terminated, truncated to json_len). Returns
// the length of the whole JSON text (a larger buffer is needed when it is >= json_len), or -1 when the structs are
// not the library's (a package and library of different versions).
FLASHJAX_EXPORT int flashjax_plan(const flashjax_problem* problem, const flashjax_device* device, char* json,
                                  int json_len) {
  if (problem == nullptr || device == nullptr || problem->struct_size != sizeof(flashjax_problem) ||
      device->struct_size != sizeof(flashjax_device)) {
    return -1;
  }
  flashjax::Problem p;
  p.dtype = static_cast<flashjax::DType>(problem->dtype);
  p.batch = problem->batch;
  p.seqlen_q = problem->seqlen_q;
  p.seqlen_k = problem->seqlen_k;
  p.heads_q = problem->heads_q;
  p.heads_k = problem->heads_k;
  p.head_dim = problem->head_dim;
  p.window_left = problem->window_left;
  p.window_right = problem->window_right;
  p.softcap = problem->softcap;
  p.has_sinks = problem->has_sinks != 0;
  p.varlen = problem->varlen != 0;
  p.mask_mod = problem->mask_mod != 0;
  p.deterministic = problem->deterministic != 0;
  p.num_splits = problem->num_splits;
  p.mask_seqlen_q = problem->mask_seqlen_q;
  p.mask_seqlen_k = problem->mask_seqlen_k;
  flashjax::DeviceProps d;
  d.sm = device->sm;
  d.smem_per_block_optin = flashjax::dispatch_smem_limit(device->sm, device->smem_per_block_optin);
  d.num_sms = device->num_sms;
  const std::string text = flashjax::plan_json(
      flashjax::plan_call(p, d, flashjax::enabled_kernel_table(), flashjax::compiled_archs()));
  if (json != nullptr && json_len > 0) {
    const size_t n = std::min(text.size(), static_cast<size_t>(json_len - 1));
    std::memcpy(json, text.data(), n);
    json[n] = '\0';
  }
  return static_cast<int>(text.size());
}

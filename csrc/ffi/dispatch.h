// Kernel choice: one pure function from (device arch, problem key) to a row of the kernel table, able to say why it
// chose or refused one. Host-only and free of CUDA calls so that GoogleTest covers it on machines without a GPU. The
// plan (plan.h) calls it for each pass of a call; everything else asks the plan.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "flashjax/choices.h"
#include "flashjax/params.h"

namespace flashjax {

// kTangent: the forward-mode derivative (t_out, t_lse) of a forward (jax.jvp; TangentParams). kJvp: the forward and
// its tangent in one kernel, (out, lse, t_out, t_lse) (jax.jvp's fused pass; JvpParams).
enum class Direction : int32_t { kFwd = 0, kBwd = 1, kTangent = 2, kJvp = 3 };

struct KernelEntry {
  const char* family;  // "sm80": the arch family the kernel is written for (its minimum compute capability)
  Direction direction;
  DType dtype;
  int32_t head_dim;
  bool arch_specific;  // uses instructions of its own arch only (sm90: wgmma, setmaxnreg): runs there alone
  // Dynamic shared memory per block the kernel launches with, in bytes (the largest of its tile configurations).
  // kernel_table() fills it from the kernel's own <direction>_smem_bytes<Element, D>() (its family's launch.h). A
  // family may have several rows of one (direction, dtype, head dim), with tiles for different shared-memory
  // budgets: dispatch takes the one with the most shared memory that the device holds.
  int32_t smem_bytes;
  const void* launch;  // cudaError_t (*)(const FwdParams&, cudaStream_t) or the BwdParams twin
  ChoiceFn choices;    // the family's per-call choices for this kernel (its launch.h's <direction>_choices)
  // A backward that can add its dq partials in a fixed order (BwdParams::deterministic). Forward kernels are
  // deterministic as they are and leave it false.
  bool deterministic = false;
  // Takes packed sequences (cu_seqlens_q set: docs/design.md §2.7); varlen calls go to such rows only
  // (tools/gen_kernels.py's VARLEN).
  bool varlen = false;
  // Takes a mask mod's bits (AttnShape::mask_bits); mask-mod calls go to such rows only (gen_kernels.py's MASK_MOD).
  bool mask_mod = false;
  // Takes the two together: packed sequences with a mask mod's bits over their padded grid (flashjax/mask_grid.h).
  // Varlen calls with a mask mod go to such rows only (gen_kernels.py's VARLEN_MASK_MOD): a family may take each
  // feature in a separate compile-time variant and not their combination.
  bool varlen_mask_mod = false;
};

// One row of a generated table (csrc/kernels/generated/kernel_table_*.inc) as a KernelEntry, with `launch` its
// launcher's address: kernel_table() passes the instantiation's, the host tests (which link no kernels) nullptr.
// targs is the instantiation's template argument list in parentheses, e.g. (cutlass::bfloat16_t, 128, 99).
#define FLASHJAX_TEMPLATE_ARGS(...) __VA_ARGS__
#define FLASHJAX_KERNEL_ENTRY(family, direction, dtype, targs, hdim, arch_specific, smem_bytes, choices,      \
                              deterministic, varlen, mask_mod, varlen_mask_mod, launch)                    \
  KernelEntry{#family,                                                                                     \
              direction,                                                                                   \
              dtype,                                                                                       \
              hdim,                                                                                        \
              arch_specific,                                                                               \
              family::smem_bytes<FLASHJAX_TEMPLATE_ARGS targs>(),                                          \
              launch,                                                                                      \
              &family::choices<FLASHJAX_TEMPLATE_ARGS targs>,                                              \
              deterministic,                                                                               \
              varlen,                                                                                      \
              mask_mod,                                                                                    \
              varlen_mask_mod},

// What dispatch needs to know of a call; the features that no kernel family implements yet are flags here.
struct ProblemKey {
  Direction direction = Direction::kFwd;
  DType dtype = DType::kBFloat16;
  int32_t head_dim = 0;  // the compiled width the call is padded to
  bool varlen = false;
  bool mask_mod = false;
  bool deterministic = false;  // backward: bitwise reproducible gradients (only rows with `deterministic` qualify)
};

struct Choice {
  const KernelEntry* kernel = nullptr;  // nullptr: no kernel runs this call; `reason` says why
  std::string reason;                   // filled where asked to explain, and always where no kernel runs the call
};

// True when code compiled for `compiled_arch` (CMake spelling: "80-real", "90a-real", "120", "80-virtual", ...)
// runs on a device of compute capability `device_sm` (major*10 + minor): SASS runs on later minors of the same
// major, PTX on any later device, "a" (arch-specific) variants only on their own arch.
bool arch_runs_on(std::string_view compiled_arch, int device_sm);

// The smallest compiled width that holds head_dim (64, 96, 128, 192, 256); 0 when head_dim > 256.
int32_t padded_head_dim(int32_t head_dim);

// The most dynamic shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin) on a device of
// compute capability `device_sm`, in bytes, from the CUDA programming guide's table: sm80/87 163 KB, sm86/89 99 KB,
// sm90 and sm100/101/103/110 227 KB, sm120/121 99 KB (sm70/72 96 KB, sm75 64 KB). An arch missing from the table
// gets the smallest figure of its era, so that dispatch never picks a kernel the device may not hold: 99 KB from
// sm80 on (the least of every arch since Ampere), 48 KB (what any CUDA device allows) before.
int32_t max_smem_per_block_optin(int device_sm);

// The kernel for `problem` on a device of compute capability `device_sm`, or none with the reason: of the rows that
// match, the newest family the device runs, and of its rows the one with the most shared memory that fits (its
// largest tiles). Kernels that need more dynamic shared memory per block than `smem_per_block_optin` bytes are
// refused (a refusal names the least the newest family's rows need); <= 0 means
// max_smem_per_block_optin(device_sm). Python asks with the table's figure (it knows the compute capability only);
// the FFI handlers pass the device's own attribute, which is the table's figure on every arch the table knows and
// at least the conservative fallback on the others, so the handler accepts whatever Python's answer chose (and
// where a device allowed less than the table says, it refuses with this reason instead of failing the launch).
// explain = false leaves the reason of a successful choice empty (the FFI handlers ask on every call).
Choice choose_kernel(int device_sm, const std::vector<std::string>& compiled_archs, const ProblemKey& problem,
                     const std::vector<KernelEntry>& table, int32_t smem_per_block_optin = 0, bool explain = true);

// A list separated by commas or semicolons (also used for family lists) ("80-real,90a-real") -> {"80-real", "90a-real"}.
std::vector<std::string> split_archs(std::string_view archs);

}  // namespace flashjax

// The plan of one attention call: which kernel runs each pass, at which compiled head width, with which of its
// family's choices (tiles, GQA packing, key splits), and what workspace XLA must allocate, each with its reason. One
// pure host function (no CUDA calls; GoogleTest covers it), asked by everyone who needs a decision:
//   - Python at trace time, through the C API's flashjax_plan (c_api.cpp): backend="auto", the head-dim padding,
//     the lowering's split count and workspace shapes, flashjax.explain and `python -m flashjax`;
//   - the FFI handlers (attention_ffi.cpp) on every call, which write the choices into FwdParams for the launcher.
// Nothing else decides anything: a family's launcher follows what its params say.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ffi/dispatch.h"
#include "flashjax/choices.h"
#include "flashjax/params.h"

namespace flashjax {

// The call as the plan sees it. head_dim is the call's own width (the larger of q's and v's); the plan pads it.
struct Problem {
  DType dtype = DType::kBFloat16;
  int32_t batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_k = 0;
  int32_t head_dim = 0;
  int32_t window_left = -1, window_right = -1;  // causal folded in as window_right = 0 (docs/design.md §2.3)
  float softcap = 0.f;
  bool has_sinks = false;
  bool varlen = false;
  bool mask_mod = false;
  bool deterministic = false;  // the backward must be bitwise reproducible
  int32_t num_splits = 0;      // forward: 0 lets the plan choose; n >= 1 is the count the lowering fixed
  // Varlen with a mask mod: the max_seqlen hints the bits were evaluated for, whose padded grid the tile classes
  // cover (flashjax/mask_grid.h). Unused otherwise.
  int32_t mask_seqlen_q = 0, mask_seqlen_k = 0;
};

// The problem of a call the FFI handler decoded (shape.head_dim is its width; varlen when shape.cu_seqlens_q is set,
// batch then being the sequence count N as Python plans it; mask_mod when shape.mask_bits is).
Problem problem_of(const AttnShape& shape, bool has_sinks, int32_t num_splits, bool deterministic = false);

// The device the call is planned for. Zeros mean unknown: the shared-memory limit then comes from the table by
// compute capability (max_smem_per_block_optin), and no call splits its keys by rule without an SM count.
struct DeviceProps {
  int32_t sm = 0;  // compute capability, major * 10 + minor
  int32_t smem_per_block_optin = 0;
  int32_t num_sms = 0;
};

// One workspace output of a pass's FFI call, in the order the handler binds them.
struct WorkspaceBuffer {
  const char* name;
  std::vector<int64_t> shape;
  const char* dtype = "float32";  // or "int32" (the deterministic backward's counters)
};

struct PassPlan {
  Direction direction = Direction::kFwd;
  const KernelEntry* kernel = nullptr;  // nullptr: no kernel runs this pass; reason says why
  std::string reason;
  FamilyChoices choices;                   // the family's, for this call (defaults where no kernel runs)
  // forward: the split target's parts (when split); backward: always the 3 f32 buffers, and with deterministic=True
  // the dq_semaphore counters of the deterministic target (flashjax_bwd_deterministic). A mask mod's pass (the
  // flashjax_*_mask_mod targets) ends with its uint8 tile classes (mask_tile_classes_layout in workspace.h).
  std::vector<WorkspaceBuffer> workspace;
};

struct Plan {
  int32_t head_dim = 0;  // the compiled width the call is padded to; 0 when no kernel width holds it
  DeviceProps device;    // as planned for, with the shared-memory limit resolved
  PassPlan fwd, bwd;
  // forward-mode (jax.jvp): the tangent pass. Not part of runs(): without a tangent kernel the lowering evaluates the
  // reference's tangent instead (primitives.py), so a call's forward and backward still run on kernels.
  PassPlan tangent;
  // jax.jvp's fused pass (out, lse, t_out, t_lse in one kernel) where a kernel has it (the sm90 family at D <= 128,
  // dense calls); elsewhere jax.jvp runs the forward and the tangent pass. Not part of runs() either.
  PassPlan jvp;
  // A call takes the kernels only when both passes have one: a traced forward may be differentiated later.
  bool runs() const { return fwd.kernel != nullptr && bwd.kernel != nullptr; }
  std::string reason;  // why it runs the kernels (the forward's reason) or the reference (the first refusal)
};

// The plan of one pass. explain = false skips the reasons of choices that succeed (the handlers plan every call).
PassPlan plan_pass(Direction direction, const Problem& problem, const DeviceProps& device,
                   const std::vector<KernelEntry>& table, const std::vector<std::string>& compiled_archs,
                   bool explain);

// The whole call: both passes, explained.
Plan plan_call(const Problem& problem, const DeviceProps& device, const std::vector<KernelEntry>& table,
               const std::vector<std::string>& compiled_archs);

// The plan as the JSON object Python reads (c_api.cpp's flashjax_plan; python/flashjax/_ffi.py's plan()).
std::string plan_json(const Plan& plan);

}  // namespace flashjax

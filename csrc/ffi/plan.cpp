#include "ffi/plan.h"

#include <cstdio>

#include "flashjax/mask_grid.h"
#include "flashjax/workspace.h"

namespace flashjax {
namespace {

// The call at its compiled width, as the families' choice functions and launchers see it (strides aside).
AttnShape compiled_shape(const Problem& problem, int32_t width) {
  AttnShape shape;
  shape.batch = problem.batch;
  shape.seqlen_q = problem.seqlen_q;
  shape.seqlen_k = problem.seqlen_k;
  shape.heads_q = problem.heads_q;
  shape.heads_k = problem.heads_k;
  shape.head_dim = width;
  shape.dtype = problem.dtype;
  shape.softcap = problem.softcap;
  shape.window_left = problem.window_left;
  shape.window_right = problem.window_right;
  shape.mask_seqlen_q = problem.mask_seqlen_q;
  shape.mask_words = mask_bits_words(problem.mask_seqlen_k);
  return shape;
}

// varlen: shape.batch is the sequence count N and seqlen_q the token count Tq (problem_of's convention).
// mask_mod: the pass's tile classes come last (mask_tile_classes_layout, for the family's tiles of this pass, with the
// block lists ahead of them where the family walks those).
std::vector<WorkspaceBuffer> workspace_of(Direction direction, const AttnShape& shape, int32_t num_splits,
                                          bool deterministic, bool varlen, bool mask_mod,
                                          const FamilyChoices& choices) {
  // The fused jvp kernel needs no workspace, nor does the tangent without a mask mod (with one: its tile classes).
  if (direction == Direction::kJvp || (direction == Direction::kTangent && !mask_mod)) return {};
  // The classes cover the bits' grid: the call's own, or varlen's N sequences padded to the hints (mask_grid.h).
  const int32_t grid_rows = varlen ? shape.mask_seqlen_q : shape.seqlen_q;
  const int32_t grid_keys = varlen ? mask_grid_keys(shape.mask_words) : shape.seqlen_k;
  const MaskTileClassesLayout classes =
      mask_tile_classes_layout(shape.batch, shape.heads_q, grid_rows, grid_keys, choices.block_m, choices.block_n,
                               choices.mask_block_lists);
  // Per-key-block lists do not come in rows per m-block: that buffer is [B, Hq, bytes per head].
  const WorkspaceBuffer classes_buffer = {
      "mask_tile_classes",
      choices.mask_block_lists == MaskBlockLists::kQueryBlocks
          ? std::vector<int64_t>{shape.batch, shape.heads_q, classes.head_bytes()}
          : std::vector<int64_t>{shape.batch, shape.heads_q, classes.m_blocks, classes.row_bytes()},
      "uint8"};
  if (direction == Direction::kTangent) return {classes_buffer};  // a mask mod's, for the tangent's own tiles
  if (direction == Direction::kFwd) {
    if (mask_mod) return {classes_buffer};  // mask-mod forwards never split
    if (varlen && choices.varlen_tile_counter) return {{"tile_counter", {kVarlenTileCounterInts}, "int32"}};
    if (num_splits <= 1) return {};
    return {{"o_partial", {shape.batch, num_splits, shape.heads_q, shape.seqlen_q, shape.head_dim}},
            {"lse_partial", {shape.batch, num_splits, shape.heads_q, shape.seqlen_q}}};
  }
  if (varlen) {  // one slab per query head, each sequence's rows placed by its offset (flashjax/workspace.h)
    const int64_t rows = bwd_varlen_rows(shape.seqlen_q, shape.batch);
    std::vector<WorkspaceBuffer> buffers = {{"dq_accum", {shape.heads_q, rows, shape.head_dim}},
                                            {"dpsum", {shape.heads_q, rows}},
                                            {"lse_log2", {shape.heads_q, rows}}};
    if (mask_mod) buffers.push_back(classes_buffer);
    return buffers;
  }
  const BwdWorkspaceLayout layout = bwd_workspace_layout(shape.batch, shape.heads_q, shape.seqlen_q, shape.head_dim);
  std::vector<WorkspaceBuffer> buffers = {
      {"dq_accum", {shape.batch, shape.heads_q, layout.seqlen_q_rounded, shape.head_dim}},
      {"dpsum", {shape.batch, shape.heads_q, layout.seqlen_q_rounded}},
      {"lse_log2", {shape.batch, shape.heads_q, layout.seqlen_q_rounded}}};
  if (deterministic) {
    buffers.push_back(
        {"dq_semaphore", {shape.batch, shape.heads_q, layout.seqlen_q_rounded / kBwdDqSemaphoreRows}, "int32"});
  }
  if (mask_mod) buffers.push_back(classes_buffer);
  return buffers;
}

// A JSON string literal.
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string pass_json(const PassPlan& pass) {
  const FamilyChoices& c = pass.choices;
  std::string workspace;
  for (const WorkspaceBuffer& buffer : pass.workspace) {
    std::string dims;
    for (const int64_t d : buffer.shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    workspace += std::string(workspace.empty() ? "" : ", ") + "{\"name\": " + quoted(buffer.name) +
                 ", \"shape\": [" + dims + "], \"dtype\": " + quoted(buffer.dtype) + "}";
  }
  return std::string("{\"family\": ") + (pass.kernel != nullptr ? quoted(pass.kernel->family) : "null") +
         ", \"smem_bytes\": " + std::to_string(pass.kernel != nullptr ? pass.kernel->smem_bytes : 0) +
         ", \"reason\": " + quoted(pass.reason) + ", \"tile_class\": " + std::to_string(c.tile_class) +
         ", \"block_m\": " + std::to_string(c.block_m) + ", \"block_n\": " + std::to_string(c.block_n) +
         ", \"pack_group\": " + std::to_string(c.pack_group) + ", \"num_splits\": " + std::to_string(c.num_splits) +
         ", \"tile_reason\": " + quoted(c.tile_reason) + ", \"packing_reason\": " + quoted(c.packing_reason) +
         ", \"split_reason\": " + quoted(c.split_reason) + ", \"workspace\": [" + workspace + "]}";
}

}  // namespace

Problem problem_of(const AttnShape& shape, bool has_sinks, int32_t num_splits, bool deterministic) {
  Problem problem;
  problem.dtype = shape.dtype;
  problem.batch = shape.batch;
  problem.seqlen_q = shape.seqlen_q;
  problem.seqlen_k = shape.seqlen_k;
  problem.heads_q = shape.heads_q;
  problem.heads_k = shape.heads_k;
  problem.head_dim = shape.head_dim;
  problem.window_left = shape.window_left;
  problem.window_right = shape.window_right;
  problem.softcap = shape.softcap;
  problem.has_sinks = has_sinks;
  problem.num_splits = num_splits;
  problem.deterministic = deterministic;
  problem.varlen = shape.cu_seqlens_q != nullptr;
  problem.mask_mod = shape.mask_bits != nullptr;
  if (problem.varlen) problem.batch = shape.num_seqs;
  if (problem.varlen && problem.mask_mod) {  // the bits' padded grid (flashjax/mask_grid.h)
    problem.mask_seqlen_q = shape.mask_seqlen_q;
    problem.mask_seqlen_k = mask_grid_keys(shape.mask_words);
  }
  return problem;
}

PassPlan plan_pass(Direction direction, const Problem& problem, const DeviceProps& device,
                   const std::vector<KernelEntry>& table, const std::vector<std::string>& compiled_archs,
                   bool explain) {
  PassPlan pass;
  pass.direction = direction;
  const int32_t width = padded_head_dim(problem.head_dim);
  if (problem.batch < 0 || problem.seqlen_q < 0 || problem.seqlen_k < 0 || problem.heads_k <= 0 ||
      problem.heads_q % problem.heads_k != 0 || problem.head_dim <= 0 || width == 0) {
    pass.reason = "no kernel takes this problem (B " + std::to_string(problem.batch) + ", Sq " +
                  std::to_string(problem.seqlen_q) + ", Sk " + std::to_string(problem.seqlen_k) + ", Hq " +
                  std::to_string(problem.heads_q) + ", Hk " + std::to_string(problem.heads_k) + ", head dim " +
                  std::to_string(problem.head_dim) + ")";
    return pass;
  }
  ProblemKey key;
  key.direction = direction;
  key.dtype = problem.dtype;
  key.head_dim = width;
  key.varlen = problem.varlen;
  key.mask_mod = problem.mask_mod;
  key.deterministic = problem.deterministic;
  Choice choice = choose_kernel(device.sm, compiled_archs, key, table, device.smem_per_block_optin, explain);
  pass.kernel = choice.kernel;
  pass.reason = std::move(choice.reason);
  const AttnShape shape = compiled_shape(problem, width);
  if (pass.kernel != nullptr && pass.kernel->choices != nullptr) {
    ChoiceQuery query;
    query.num_sms = device.num_sms;
    query.num_splits = direction == Direction::kFwd ? problem.num_splits : 1;
    query.explain = explain;
    query.varlen = problem.varlen;
    query.mask_mod = problem.mask_mod;
    pass.choices = pass.kernel->choices(shape, query);
  }
  pass.workspace = workspace_of(direction, shape, pass.choices.num_splits, problem.deterministic, problem.varlen,
                                problem.mask_mod && pass.kernel != nullptr, pass.choices);
  return pass;
}

Plan plan_call(const Problem& problem, const DeviceProps& device, const std::vector<KernelEntry>& table,
               const std::vector<std::string>& compiled_archs) {
  Plan plan;
  plan.head_dim = padded_head_dim(problem.head_dim);
  plan.device = device;
  if (plan.device.smem_per_block_optin <= 0) plan.device.smem_per_block_optin = max_smem_per_block_optin(device.sm);
  plan.fwd = plan_pass(Direction::kFwd, problem, plan.device, table, compiled_archs, true);
  plan.bwd = plan_pass(Direction::kBwd, problem, plan.device, table, compiled_archs, true);
  plan.tangent = plan_pass(Direction::kTangent, problem, plan.device, table, compiled_archs, true);
  plan.jvp = plan_pass(Direction::kJvp, problem, plan.device, table, compiled_archs, true);
  plan.reason = plan.fwd.kernel == nullptr ? plan.fwd.reason
                : plan.bwd.kernel == nullptr ? plan.bwd.reason
                                             : plan.fwd.reason;
  return plan;
}

std::string plan_json(const Plan& plan) {
  return std::string("{\"runs\": ") + (plan.runs() ? "true" : "false") + ", \"reason\": " + quoted(plan.reason) +
         ", \"head_dim\": " + std::to_string(plan.head_dim) + ", \"device\": {\"sm\": " +
         std::to_string(plan.device.sm) + ", \"smem_per_block_optin\": " +
         std::to_string(plan.device.smem_per_block_optin) + ", \"num_sms\": " + std::to_string(plan.device.num_sms) +
         "}, \"fwd\": " + pass_json(plan.fwd) + ", \"bwd\": " + pass_json(plan.bwd) +
         ", \"tangent\": " + pass_json(plan.tangent) + ", \"jvp\": " + pass_json(plan.jvp) + "}";
}

}  // namespace flashjax

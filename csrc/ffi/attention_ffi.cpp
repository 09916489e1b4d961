// XLA FFI handlers: decode buffers and attributes into FwdParams/BwdParams, check them, plan the pass with the plan
// Python asked at trace time (plan.h), write its choices into the params, and launch on XLA's stream.
//
// Handlers are command-buffer compatible: they only launch kernels (and stream-ordered memsets) on the given
// stream, never synchronize, allocate or read device data on the host.
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <atomic>
#include <string>
#include <utility>

#include "ffi/dispatch.h"
#include "ffi/kernel_table.h"
#include "ffi/plan.h"
#include "ffi/strides.h"
#include "flashjax/mask_grid.h"
#include "flashjax/params.h"
#include "flashjax/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashjax {
namespace {

// Compute capability per device ordinal, read once: attribute queries are cheap but need no repeating.
int device_sm(int32_t ordinal) {
  static std::array<std::atomic<int>, 64> cache{};
  if (ordinal < 0 || ordinal >= static_cast<int32_t>(cache.size())) return 0;
  int sm = cache[ordinal].load(std::memory_order_relaxed);
  if (sm == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal) != cudaSuccess) {
      return 0;
    }
    sm = major * 10 + minor;
    cache[ordinal].store(sm, std::memory_order_relaxed);
  }
  return sm;
}

// The most dynamic shared memory a block may opt into on the device, read once per ordinal; 0 when unknown, which
// makes dispatch use its table for the device's compute capability (the figure Python's trace-time choice used).
int device_smem_per_block_optin(int32_t ordinal) {
  static std::array<std::atomic<int>, 64> cache{};
  if (ordinal < 0 || ordinal >= static_cast<int32_t>(cache.size())) return 0;
  int bytes = cache[ordinal].load(std::memory_order_relaxed);
  if (bytes == 0) {
    if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal) != cudaSuccess) return 0;
    cache[ordinal].store(bytes, std::memory_order_relaxed);
  }
  return bytes;
}

ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument("flashjax: " + what); }

std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Fills shapes, contiguous strides and semantics from q [B, Sq, Hq, D] and k [B, Sk, Hk, D]; checks that
// every tensor agrees (Python validated already; this guards against a mismatched lowering).
// varlen_dims: q's and k's [B, S, H, D] for varlen's rank-3 operands (B = 1), which fill_varlen_shape checked.
ffi::Error fill_shape(AttnShape& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                      float softmax_scale, float softcap, int32_t window_left, int32_t window_right,
                      const int64_t* varlen_dims = nullptr) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (varlen_dims != nullptr) {
    qd = ffi::Span<const int64_t>(varlen_dims, 4);
    kd = vd = ffi::Span<const int64_t>(varlen_dims + 4, 4);
  }
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return invalid("q, k, v must be rank 4 [B, S, H, D], got " + dims_str(qd) + ", " + dims_str(kd) + ", " +
                   dims_str(vd));
  }
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type()) {
    return invalid("q, k, v must share one dtype");
  }
  if (q.element_type() == ffi::DataType::F16) {
    p.dtype = DType::kFloat16;
  } else if (q.element_type() == ffi::DataType::BF16) {
    p.dtype = DType::kBFloat16;
  } else {
    return invalid("q, k, v must be float16 or bfloat16");
  }
  p.batch = static_cast<int32_t>(qd[0]);
  p.seqlen_q = static_cast<int32_t>(qd[1]);
  p.heads_q = static_cast<int32_t>(qd[2]);
  p.head_dim = static_cast<int32_t>(qd[3]);
  p.seqlen_k = static_cast<int32_t>(kd[1]);
  p.heads_k = static_cast<int32_t>(kd[2]);
  if (kd[0] != qd[0] || kd[3] != qd[3] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != qd[3] ||
      p.heads_k == 0 || p.heads_q % p.heads_k != 0) {
    return invalid("inconsistent shapes q " + dims_str(qd) + ", k " + dims_str(kd) + ", v " + dims_str(vd));
  }
  set_contiguous_strides(p);
  p.softmax_scale = softmax_scale;
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  return ffi::Error::Success();
}

// The per-call f32 operands that are optional (fwd: sinks; bwd: dlse, sinks) come after the required ones, in that
// slot order. The lowering passes only those whose has_* attribute is set: an unused one passed as a zero array
// would cost a fill kernel of XLA's before every call. Calls lowered before that (flashjax 0.1.0, e.g. in a
// jax.export artifact) pass every slot, the unused ones as placeholders; those are recognized by their count (all
// slots) and skipped, so old artifacts keep running. With every flag set the two layouts are the same.
class OptionalOperands {
 public:
  OptionalOperands(const ffi::RemainingArgs& rest, size_t slots) : rest_(rest), every_slot_(rest.size() == slots) {}

  // The next slot's data (checked to hold `elements` values of kType: f32, or s32 for varlen's seqused), or nullptr
  // when the slot's flag is off.
  template <ffi::DataType kType = ffi::F32, typename T>
  ffi::Error take(bool present, size_t elements, const char* name, const T*& data) {
    data = nullptr;
    if (!present) {
      next_ += every_slot_ ? 1 : 0;  // a placeholder to step over
      return ffi::Error::Success();
    }
    if (next_ >= rest_.size()) return invalid(std::string(name) + " is flagged present but was not passed");
    auto buffer = rest_.get<ffi::Buffer<kType>>(next_++);
    if (buffer.has_error()) {
      return invalid(std::string(name) + (kType == ffi::F32 ? " must be a float32 array" : " must be an int32 array"));
    }
    if (buffer->element_count() != elements) {
      return invalid(std::string(name) + " must have " + std::to_string(elements) + " elements, got " +
                     std::to_string(buffer->element_count()));
    }
    data = buffer->typed_data();
    return ffi::Error::Success();
  }

  // After the last slot: nothing may be left over.
  ffi::Error finish() const {
    if (next_ == rest_.size()) return ffi::Error::Success();
    return invalid(std::to_string(rest_.size()) + " optional operand(s) do not match the has_* attributes");
  }

 private:
  const ffi::RemainingArgs& rest_;
  bool every_slot_;
  size_t next_ = 0;
};

// The pass's plan for the device the handler runs on. num_splits: the forward's count fixed at lowering (1 for the
// plain target), which sized the workspace.
PassPlan plan_for(int32_t ordinal, Direction direction, const AttnShape& shape, bool has_sinks, int32_t num_splits,
                  bool explain, bool deterministic = false) {
  const Problem problem = problem_of(shape, has_sinks, num_splits, deterministic);
  DeviceProps device;
  device.sm = device_sm(ordinal);
  device.smem_per_block_optin = dispatch_smem_limit(device.sm, device_smem_per_block_optin(ordinal));
  return plan_pass(direction, problem, device, enabled_kernel_table(), compiled_archs(), explain);
}

// The planned kernel's launch, or the reason no kernel runs the pass (a refusal is always explained).
template <typename Params>
ffi::Error launch(const PassPlan& plan, const Params& params, cudaStream_t stream) {
  if (plan.kernel == nullptr) return invalid(plan.reason);
  using LaunchFn = cudaError_t (*)(const Params&, cudaStream_t);
  const cudaError_t err = reinterpret_cast<LaunchFn>(plan.kernel->launch)(params, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("flashjax: kernel launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// The forward's plan into its params: what the family's launcher follows.
void apply_choices(const PassPlan& plan, FwdParams& p) {
  p.tile_class = plan.choices.tile_class;
  p.pack_group = plan.choices.pack_group;
  p.num_splits = plan.choices.num_splits;
}

// The forward's operands and attributes (both targets).
ffi::Error fill_fwd(FwdParams& p, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    const ffi::RemainingArgs& optional, ffi::Result<ffi::AnyBuffer>& o,
                    ffi::Result<ffi::Buffer<ffi::F32>>& lse, bool has_sinks, float softcap, float softmax_scale,
                    int32_t window_left, int32_t window_right) {
  if (auto err = fill_shape(p, q, k, v, softmax_scale, softcap, window_left, window_right); err.failure()) {
    return err;
  }
  OptionalOperands slots(optional, 1);
  if (auto err = slots.take(has_sinks, p.heads_q, "sinks", p.sinks); err.failure()) return err;
  if (auto err = slots.finish(); err.failure()) return err;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  return ffi::Error::Success();
}

// A mask mod's bits (dense calls; layout in flashjax/params.h): uint32 [Bm, Hm, Sq, Wk] with Bm 1 or B, Hm 1 or Hq,
// Wk = ceil(Sk / 32). Their values are device data the kernels read only inside these bounds.
ffi::Error fill_mask_bits(AttnShape& p, const ffi::Buffer<ffi::U32>& bits) {
  const auto d = bits.dimensions();
  const int64_t words = mask_bits_words(p.seqlen_k);
  if (d.size() != 4 || (d[0] != 1 && d[0] != p.batch) || (d[1] != 1 && d[1] != p.heads_q) || d[2] != p.seqlen_q ||
      d[3] != words) {
    return invalid("mask_bits must be uint32 [1 or B, 1 or Hq, Sq, ceil(Sk / 32)] = [1 or " +
                   std::to_string(p.batch) + ", 1 or " + std::to_string(p.heads_q) + ", " +
                   std::to_string(p.seqlen_q) + ", " + std::to_string(words) + "], got " + dims_str(d));
  }
  p.mask_bits = bits.typed_data();
  p.mask_words = static_cast<int32_t>(words);
  p.mask_head_stride = d[1] > 1 ? int64_t(p.seqlen_q) * words : 0;
  p.mask_batch_stride = d[0] > 1 ? d[1] * int64_t(p.seqlen_q) * words : 0;
  // B = 1 or Hq = 1: a stride of 0 reads the same words, so "broadcast" and "per batch / head" are the same layout.
  return ffi::Error::Success();
}

// Varlen's bits (after fill_varlen_shape): uint32 [1 or N, 1 or Hq, max_seqlen_q, Wk], the N sequences padded to the
// max_seqlen hints the bits were evaluated for (flashjax/mask_grid.h), whose row count and width are taken from the
// buffer itself: the kernels never read past them, whatever the offsets hold.
ffi::Error fill_varlen_mask_bits(AttnShape& p, const ffi::Buffer<ffi::U32>& bits) {
  const auto d = bits.dimensions();
  if (d.size() != 4 || (d[0] != 1 && d[0] != p.num_seqs) || (d[1] != 1 && d[1] != p.heads_q) || d[2] > INT32_MAX ||
      d[3] > INT32_MAX / 32) {
    return invalid("varlen mask_bits must be uint32 [1 or N, 1 or Hq, max_seqlen_q, ceil(max_seqlen_k / 32)] with N " +
                   std::to_string(p.num_seqs) + ", Hq " + std::to_string(p.heads_q) + ", got " + dims_str(d));
  }
  p.mask_bits = bits.typed_data();
  p.mask_seqlen_q = static_cast<int32_t>(d[2]);
  p.mask_words = static_cast<int32_t>(d[3]);
  p.mask_head_stride = d[1] > 1 ? d[2] * d[3] : 0;
  p.mask_batch_stride = d[0] > 1 ? d[1] * d[2] * d[3] : 0;
  return ffi::Error::Success();
}

// The pass's tile-class workspace, checked against mask_tile_classes_layout for the planned kernel's tiles over the
// bits' grid (a packed call's: its N padded sequences, mask_grid.h).
ffi::Error take_mask_tile_classes(AttnShape& p, const PassPlan& plan, ffi::Result<ffi::Buffer<ffi::U8>>& classes) {
  const AttnShape grid = mask_bits_grid(p);
  const MaskTileClassesLayout layout =
      mask_tile_classes_layout(grid.batch, grid.heads_q, grid.seqlen_q, grid.seqlen_k, plan.choices.block_m,
                               plan.choices.block_n, plan.choices.mask_block_lists);
  if (plan.choices.block_m <= 0 || classes->element_count() < static_cast<size_t>(layout.bytes)) {
    return invalid("mask-mod tile-class workspace has " + std::to_string(classes->element_count()) +
                   " bytes; the planned kernel's tiles need " + std::to_string(layout.bytes));
  }
  // Block lists first (int32, at the buffer's start, which XLA aligns), then the classes.
  p.mask_block_lists = layout.block_lists(classes->typed_data());
  p.mask_tile_classes = layout.tile_classes(classes->typed_data());
  return ffi::Error::Success();
}

ffi::Error fwd_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> o,
                    ffi::Result<ffi::Buffer<ffi::F32>> lse, bool has_sinks, float softcap, float softmax_scale,
                    int32_t window_left, int32_t window_right) {
  FwdParams p;
  if (auto err = fill_fwd(p, q, k, v, optional, o, lse, has_sinks, softcap, softmax_scale, window_left, window_right);
      err.failure()) {
    return err;
  }
  const PassPlan plan = plan_for(ordinal, Direction::kFwd, p, has_sinks, /*num_splits=*/1, /*explain=*/false);
  apply_choices(plan, p);
  return launch(plan, p, stream);
}

// The forward with a mask mod (issue 38; a separate target, so that the plain one keeps the signature exported calls
// were lowered with): q, k, v, the mask bits, then sinks as has_sinks says; o, lse and the tile-class workspace.
ffi::Error fwd_mask_mod_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::Buffer<ffi::U32> mask_bits, ffi::RemainingArgs optional,
                             ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             ffi::Result<ffi::Buffer<ffi::U8>> tile_classes, bool has_sinks, float softcap,
                             float softmax_scale, int32_t window_left, int32_t window_right) {
  FwdParams p;
  if (auto err = fill_fwd(p, q, k, v, optional, o, lse, has_sinks, softcap, softmax_scale, window_left, window_right);
      err.failure()) {
    return err;
  }
  if (auto err = fill_mask_bits(p, mask_bits); err.failure()) return err;
  const PassPlan plan = plan_for(ordinal, Direction::kFwd, p, has_sinks, /*num_splits=*/1, /*explain=*/false);
  if (plan.kernel == nullptr) return launch(plan, p, stream);
  if (auto err = take_mask_tile_classes(p, plan, tile_classes); err.failure()) return err;
  apply_choices(plan, p);
  return launch(plan, p, stream);
}

// The forward with split keys (a separate target, so that the plain one keeps the signature exported calls were
// lowered with): num_splits parts per tile, partial results in the two workspace outputs.
ffi::Error fwd_split_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> o,
                          ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::F32>> o_partial,
                          ffi::Result<ffi::Buffer<ffi::F32>> lse_partial, bool has_sinks, int32_t num_splits,
                          float softcap, float softmax_scale, int32_t window_left, int32_t window_right) {
  FwdParams p;
  if (auto err = fill_fwd(p, q, k, v, optional, o, lse, has_sinks, softcap, softmax_scale, window_left, window_right);
      err.failure()) {
    return err;
  }
  if (num_splits < 1) return invalid("num_splits must be at least 1, got " + std::to_string(num_splits));
  const PassPlan plan = plan_for(ordinal, Direction::kFwd, p, has_sinks, num_splits, /*explain=*/false);
  if (plan.kernel == nullptr) return launch(plan, p, stream);
  // The workspace XLA allocated for the lowering's count; a family that does not split leaves it unused.
  const FwdSplitWorkspaceLayout workspace =
      fwd_split_workspace_layout(p.batch, num_splits, p.heads_q, p.seqlen_q, p.head_dim);
  if (o_partial->element_count() < static_cast<size_t>(workspace.o_partial) ||
      lse_partial->element_count() < static_cast<size_t>(workspace.lse_partial)) {
    return invalid("split-keys workspace is smaller than the problem needs");
  }
  apply_choices(plan, p);
  p.o_partial = o_partial->typed_data();
  p.lse_partial = lse_partial->typed_data();
  return launch(plan, p, stream);
}

// Varlen's shapes: q [Tq, Hq, D], k/v [Tk, Hk, D], cu_seqlens_q/_k [N + 1] int32 (their values are the kernels' to
// clamp: device data, never read here). Fills the descriptor as one batch of Tq / Tk rows (params.h), lse [Hq, Tq].
ffi::Error fill_varlen_shape(AttnShape& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                             const ffi::Buffer<ffi::S32>& cu_seqlens_q, const ffi::Buffer<ffi::S32>& cu_seqlens_k,
                             float softmax_scale, float softcap, int32_t window_left, int32_t window_right) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3) {
    return invalid("varlen q, k, v must be rank 3 [T, H, D], got " + dims_str(qd) + ", " + dims_str(kd) + ", " +
                   dims_str(vd));
  }
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return invalid("varlen v must be shaped like k, got k " + dims_str(kd) + ", v " + dims_str(vd));
  }
  const int64_t bounds[] = {1, qd[0], qd[1], qd[2], 1, kd[0], kd[1], kd[2]};
  if (auto err = fill_shape(p, q, k, v, softmax_scale, softcap, window_left, window_right, bounds); err.failure()) {
    return err;
  }
  const size_t offsets = cu_seqlens_q.element_count();
  if (offsets == 0 || cu_seqlens_k.element_count() != offsets || cu_seqlens_q.dimensions().size() != 1) {
    return invalid("cu_seqlens_q and cu_seqlens_k must both be [N + 1] int32, got " +
                   dims_str(cu_seqlens_q.dimensions()) + " and " + dims_str(cu_seqlens_k.dimensions()));
  }
  p.num_seqs = static_cast<int32_t>(offsets - 1);
  p.cu_seqlens_q = cu_seqlens_q.typed_data();
  p.cu_seqlens_k = cu_seqlens_k.typed_data();
  p.lse_batch_stride = 0;  // lse [Hq, Tq]: set_contiguous_strides' head stride (Tq) already holds
  return ffi::Error::Success();
}

// The varlen forward: operands as fill_varlen_shape's; optional seqused_q, seqused_k ([N] int32) and sinks ([Hq]
// f32), in that order, as their flags say. tile_counter: the dynamic walk's workspace (flashjax_fwd_varlen_dynamic),
// nullptr for the other targets. mask_bits / tile_classes: the mask-mod target's (nullptr: the others).
ffi::Error run_fwd_varlen(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k,
                          const ffi::RemainingArgs& optional, ffi::Result<ffi::AnyBuffer>& o,
                          ffi::Result<ffi::Buffer<ffi::F32>>& lse, int32_t* tile_counter, bool has_seqused_k,
                          bool has_seqused_q, bool has_sinks, float softcap, float softmax_scale, int32_t window_left,
                          int32_t window_right, const ffi::Buffer<ffi::U32>* mask_bits = nullptr,
                          ffi::Result<ffi::Buffer<ffi::U8>>* tile_classes = nullptr) {
  FwdParams p;
  if (auto err = fill_varlen_shape(p, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, softcap, window_left,
                                   window_right);
      err.failure()) {
    return err;
  }
  if (mask_bits != nullptr) {
    if (auto err = fill_varlen_mask_bits(p, *mask_bits); err.failure()) return err;
  }
  OptionalOperands slots(optional, 3);
  const size_t n = static_cast<size_t>(p.num_seqs);
  if (auto err = slots.take<ffi::S32>(has_seqused_q, n, "seqused_q", p.seqused_q); err.failure()) return err;
  if (auto err = slots.take<ffi::S32>(has_seqused_k, n, "seqused_k", p.seqused_k); err.failure()) return err;
  if (auto err = slots.take(has_sinks, p.heads_q, "sinks", p.sinks); err.failure()) return err;
  if (auto err = slots.finish(); err.failure()) return err;
  if (o->element_count() != q.element_count() || lse->element_count() != size_t(p.heads_q) * p.seqlen_q) {
    return invalid("varlen o must be shaped like q and lse [Hq, Tq]");
  }
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  p.varlen_tile_counter = tile_counter;
  const PassPlan plan = plan_for(ordinal, Direction::kFwd, p, has_sinks, /*num_splits=*/1, /*explain=*/false);
  if (plan.kernel != nullptr && tile_classes != nullptr) {
    if (auto err = take_mask_tile_classes(p, plan, *tile_classes); err.failure()) return err;
  }
  apply_choices(plan, p);
  return launch(plan, p, stream);
}

ffi::Error fwd_varlen_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k,
                           ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, bool has_seqused_k, bool has_seqused_q,
                           bool has_sinks, float softcap, float softmax_scale, int32_t window_left,
                           int32_t window_right) {
  return run_fwd_varlen(stream, ordinal, q, k, v, cu_seqlens_q, cu_seqlens_k, optional, o, lse, nullptr,
                        has_seqused_k, has_seqused_q, has_sinks, softcap, softmax_scale, window_left, window_right);
}

// The same with the dynamic walk's counter (FLASHJAX_SM90_VARLEN_WALK=2; the plan's tile_counter workspace), which
// the launcher zeroes; a family that walks statically leaves it unused.
ffi::Error fwd_varlen_dynamic_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                   ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::RemainingArgs optional,
                                   ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                   ffi::Result<ffi::Buffer<ffi::S32>> tile_counter, bool has_seqused_k,
                                   bool has_seqused_q, bool has_sinks, float softcap, float softmax_scale,
                                   int32_t window_left, int32_t window_right) {
  if (tile_counter->element_count() < static_cast<size_t>(kVarlenTileCounterInts)) {
    return invalid("varlen tile-counter workspace is smaller than the walk needs");
  }
  return run_fwd_varlen(stream, ordinal, q, k, v, cu_seqlens_q, cu_seqlens_k, optional, o, lse,
                        tile_counter->typed_data(), has_seqused_k, has_seqused_q, has_sinks, softcap, softmax_scale,
                        window_left, window_right);
}

// The varlen forward with a mask mod (issue 38): the offsets, then the bits [1 or N, 1 or Hq, max_seqlen_q, Wk]
// (mask_grid.h), then the optional operands; o, lse and the tile-class workspace of the padded grid.
ffi::Error fwd_varlen_mask_mod_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                    ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Buffer<ffi::U32> mask_bits,
                                    ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> o,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                    ffi::Result<ffi::Buffer<ffi::U8>> tile_classes, bool has_seqused_k,
                                    bool has_seqused_q, bool has_sinks, float softcap, float softmax_scale,
                                    int32_t window_left, int32_t window_right) {
  return run_fwd_varlen(stream, ordinal, q, k, v, cu_seqlens_q, cu_seqlens_k, optional, o, lse, nullptr,
                        has_seqused_k, has_seqused_q, has_sinks, softcap, softmax_scale, window_left, window_right,
                        &mask_bits, &tile_classes);
}

// What every backward target shares once the shape is filled and the pass planned: the workspace checked against
// its layout, the operands (the optional dlse and sinks next in `slots`), the gradients, the launch.
ffi::Error launch_backward(cudaStream_t stream, BwdParams& p, const PassPlan& plan,
                           const BwdWorkspaceLayout& workspace, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse,
                           ffi::AnyBuffer dout, OptionalOperands& slots, ffi::Result<ffi::AnyBuffer>& dq,
                           ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                           ffi::Result<ffi::Buffer<ffi::F32>>& dsinks, ffi::Result<ffi::Buffer<ffi::F32>>& dq_accum,
                           ffi::Result<ffi::Buffer<ffi::F32>>& dpsum, ffi::Result<ffi::Buffer<ffi::F32>>& lse_log2,
                           bool has_dlse, bool has_sinks) {
  if (dq_accum->element_count() < static_cast<size_t>(workspace.dq_accum) ||
      dpsum->element_count() < static_cast<size_t>(workspace.per_row) ||
      lse_log2->element_count() < static_cast<size_t>(workspace.per_row)) {
    return invalid("backward workspace is smaller than the problem needs");
  }
  p.o = o.untyped_data();
  p.lse = lse.typed_data();
  p.dout = dout.untyped_data();
  const size_t rows = static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q;
  if (auto err = slots.take(has_dlse, rows, "dlse", p.dlse); err.failure()) return err;
  if (auto err = slots.take(has_sinks, p.heads_q, "sinks", p.sinks); err.failure()) return err;
  if (auto err = slots.finish(); err.failure()) return err;
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dsinks = has_sinks ? dsinks->typed_data() : nullptr;
  set_gradient_strides(p);
  p.dq_accum = dq_accum->typed_data();
  p.dpsum = dpsum->typed_data();
  p.lse_log2 = lse_log2->typed_data();
  p.seqlen_q_rounded = workspace.seqlen_q_rounded;
  if (!has_sinks && dsinks->element_count() > 0) {
    // Keep the unused output defined: XLA may hand it to other ops.
    cudaMemsetAsync(dsinks->typed_data(), 0, dsinks->size_bytes(), stream);
  }
  return launch(plan, p, stream);
}

// Both dense backward targets. dq_semaphore: the deterministic target's counters (nullptr: the plain target, any
// order).
ffi::Error run_backward(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                        const ffi::RemainingArgs& optional, ffi::Result<ffi::AnyBuffer>& dq,
                        ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                        ffi::Result<ffi::Buffer<ffi::F32>>& dsinks, ffi::Result<ffi::Buffer<ffi::F32>>& dq_accum,
                        ffi::Result<ffi::Buffer<ffi::F32>>& dpsum, ffi::Result<ffi::Buffer<ffi::F32>>& lse_log2,
                        ffi::Result<ffi::Buffer<ffi::S32>>* dq_semaphore, bool has_dlse, bool has_sinks,
                        float softcap, float softmax_scale, int32_t window_left, int32_t window_right,
                        const ffi::Buffer<ffi::U32>* mask_bits = nullptr,
                        ffi::Result<ffi::Buffer<ffi::U8>>* tile_classes = nullptr) {
  BwdParams p;
  if (auto err = fill_shape(p, q, k, v, softmax_scale, softcap, window_left, window_right); err.failure()) {
    return err;
  }
  if (mask_bits != nullptr) {
    if (auto err = fill_mask_bits(p, *mask_bits); err.failure()) return err;
  }
  p.deterministic = dq_semaphore != nullptr;
  const PassPlan plan = plan_for(ordinal, Direction::kBwd, p, has_sinks, /*num_splits=*/1, /*explain=*/false,
                                 p.deterministic);
  if (plan.kernel == nullptr) return launch(plan, p, stream);
  if (tile_classes != nullptr) {
    if (auto err = take_mask_tile_classes(p, plan, *tile_classes); err.failure()) return err;
  }
  if (p.deterministic) {
    if ((*dq_semaphore)->element_count() < static_cast<size_t>(bwd_dq_semaphores(p.batch, p.heads_q, p.seqlen_q))) {
      return invalid("deterministic backward's dq_semaphore workspace is smaller than the problem needs");
    }
    p.dq_semaphore = (*dq_semaphore)->typed_data();
  }
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  OptionalOperands slots(optional, 2);
  return launch_backward(stream, p, plan, bwd_workspace_layout(p.batch, p.heads_q, p.seqlen_q, p.head_dim), o, lse,
                         dout, slots, dq, dk, dv, dsinks, dq_accum, dpsum, lse_log2, has_dlse, has_sinks);
}

ffi::Error bwd_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::RemainingArgs optional,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                    ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dsinks,
                    ffi::Result<ffi::Buffer<ffi::F32>> dq_accum, ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                    ffi::Result<ffi::Buffer<ffi::F32>> lse_log2, bool has_dlse, bool has_sinks, float softcap,
                    float softmax_scale, int32_t window_left, int32_t window_right) {
  return run_backward(stream, ordinal, q, k, v, o, lse, dout, optional, dq, dk, dv, dsinks, dq_accum, dpsum, lse_log2,
                      nullptr, has_dlse, has_sinks, softcap, softmax_scale, window_left, window_right);
}

// deterministic=True: the same call with the counters that order the dq accumulation.
ffi::Error bwd_deterministic_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                  ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                                  ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> dq,
                                  ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dsinks,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                                  ffi::Result<ffi::Buffer<ffi::F32>> lse_log2,
                                  ffi::Result<ffi::Buffer<ffi::S32>> dq_semaphore, bool has_dlse, bool has_sinks,
                                  float softcap, float softmax_scale, int32_t window_left, int32_t window_right) {
  return run_backward(stream, ordinal, q, k, v, o, lse, dout, optional, dq, dk, dv, dsinks, dq_accum, dpsum, lse_log2,
                      &dq_semaphore, has_dlse, has_sinks, softcap, softmax_scale, window_left, window_right);
}

// The backward with a mask mod (issue 38): the dense backward's operands with the forward's mask bits after dout
// (the same array: a residual, not recomputed), and the tile-class workspace after the f32 one.
ffi::Error bwd_mask_mod_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                             ffi::Buffer<ffi::U32> mask_bits, ffi::RemainingArgs optional,
                             ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                             ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dsinks,
                             ffi::Result<ffi::Buffer<ffi::F32>> dq_accum, ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                             ffi::Result<ffi::Buffer<ffi::F32>> lse_log2,
                             ffi::Result<ffi::Buffer<ffi::U8>> tile_classes, bool has_dlse, bool has_sinks,
                             float softcap, float softmax_scale, int32_t window_left, int32_t window_right) {
  return run_backward(stream, ordinal, q, k, v, o, lse, dout, optional, dq, dk, dv, dsinks, dq_accum, dpsum, lse_log2,
                      nullptr, has_dlse, has_sinks, softcap, softmax_scale, window_left, window_right, &mask_bits,
                      &tile_classes);
}

// deterministic=True with a mask mod: the mask-mod target's operands; its results with the counters that order the
// dq accumulation between the f32 workspace and the tile classes (workspace_of's order).
ffi::Error bwd_mask_mod_deterministic_impl(
    cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
    ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::U32> mask_bits, ffi::RemainingArgs optional,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    ffi::Result<ffi::Buffer<ffi::F32>> dsinks, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
    ffi::Result<ffi::Buffer<ffi::F32>> dpsum, ffi::Result<ffi::Buffer<ffi::F32>> lse_log2,
    ffi::Result<ffi::Buffer<ffi::S32>> dq_semaphore, ffi::Result<ffi::Buffer<ffi::U8>> tile_classes, bool has_dlse,
    bool has_sinks, float softcap, float softmax_scale, int32_t window_left, int32_t window_right) {
  return run_backward(stream, ordinal, q, k, v, o, lse, dout, optional, dq, dk, dv, dsinks, dq_accum, dpsum, lse_log2,
                      &dq_semaphore, has_dlse, has_sinks, softcap, softmax_scale, window_left, window_right, &mask_bits,
                      &tile_classes);
}

// The varlen backward: q, k, v, o, lse [Hq, Tq], dout, the offsets, then the optional seqused_q, seqused_k ([N]
// int32), dlse ([Hq, Tq]) and sinks ([Hq]) as their flags say; the gradients and the workspace of
// bwd_varlen_workspace_layout (one slab per query head, rows placed per sequence).
// mask_bits / tile_classes: the mask-mod target's (nullptr: the plain one).
ffi::Error run_bwd_varlen(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                          ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k,
                          const ffi::RemainingArgs& optional, ffi::Result<ffi::AnyBuffer>& dq,
                          ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                          ffi::Result<ffi::Buffer<ffi::F32>>& dsinks, ffi::Result<ffi::Buffer<ffi::F32>>& dq_accum,
                          ffi::Result<ffi::Buffer<ffi::F32>>& dpsum, ffi::Result<ffi::Buffer<ffi::F32>>& lse_log2,
                          bool has_dlse, bool has_seqused_k, bool has_seqused_q, bool has_sinks, float softcap,
                          float softmax_scale, int32_t window_left, int32_t window_right,
                          const ffi::Buffer<ffi::U32>* mask_bits = nullptr,
                          ffi::Result<ffi::Buffer<ffi::U8>>* tile_classes = nullptr) {
  BwdParams p;
  if (auto err = fill_varlen_shape(p, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, softcap, window_left,
                                   window_right);
      err.failure()) {
    return err;
  }
  if (mask_bits != nullptr) {
    if (auto err = fill_varlen_mask_bits(p, *mask_bits); err.failure()) return err;
  }
  if (o.element_count() != q.element_count() || dout.element_count() != q.element_count() ||
      lse.element_count() != size_t(p.heads_q) * p.seqlen_q) {
    return invalid("varlen o and dout must be shaped like q and lse [Hq, Tq]");
  }
  const PassPlan plan = plan_for(ordinal, Direction::kBwd, p, has_sinks, /*num_splits=*/1, /*explain=*/false);
  if (plan.kernel == nullptr) return launch(plan, p, stream);
  if (tile_classes != nullptr) {
    if (auto err = take_mask_tile_classes(p, plan, *tile_classes); err.failure()) return err;
  }
  const BwdWorkspaceLayout workspace = bwd_varlen_workspace_layout(p.seqlen_q, p.num_seqs, p.heads_q, p.head_dim);
  if (workspace.seqlen_q_rounded == 0 && p.num_seqs > 0) {
    return invalid("varlen backward: Tq + N * " + std::to_string(kBwdVarlenRowBlock) +
                   " workspace rows exceed int32");
  }
  OptionalOperands slots(optional, 4);
  const size_t n = static_cast<size_t>(p.num_seqs);
  if (auto err = slots.take<ffi::S32>(has_seqused_q, n, "seqused_q", p.seqused_q); err.failure()) return err;
  if (auto err = slots.take<ffi::S32>(has_seqused_k, n, "seqused_k", p.seqused_k); err.failure()) return err;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  return launch_backward(stream, p, plan, workspace, o, lse, dout, slots, dq, dk, dv, dsinks, dq_accum, dpsum,
                         lse_log2, has_dlse, has_sinks);
}

ffi::Error bwd_varlen_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                           ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k,
                           ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dsinks,
                           ffi::Result<ffi::Buffer<ffi::F32>> dq_accum, ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse_log2, bool has_dlse, bool has_seqused_k,
                           bool has_seqused_q, bool has_sinks, float softcap, float softmax_scale,
                           int32_t window_left, int32_t window_right) {
  return run_bwd_varlen(stream, ordinal, q, k, v, o, lse, dout, cu_seqlens_q, cu_seqlens_k, optional, dq, dk, dv,
                        dsinks, dq_accum, dpsum, lse_log2, has_dlse, has_seqused_k, has_seqused_q, has_sinks, softcap,
                        softmax_scale, window_left, window_right);
}

// The varlen backward with a mask mod (issue 38): the offsets, then the forward's bits (the same array, a residual),
// then the optional operands; the gradients, the f32 workspace and the tile classes of the padded grid.
ffi::Error bwd_varlen_mask_mod_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse,
                                    ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                    ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Buffer<ffi::U32> mask_bits,
                                    ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> dq,
                                    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                    ffi::Result<ffi::Buffer<ffi::F32>> dsinks,
                                    ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                                    ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse_log2,
                                    ffi::Result<ffi::Buffer<ffi::U8>> tile_classes, bool has_dlse,
                                    bool has_seqused_k, bool has_seqused_q, bool has_sinks, float softcap,
                                    float softmax_scale, int32_t window_left, int32_t window_right) {
  return run_bwd_varlen(stream, ordinal, q, k, v, o, lse, dout, cu_seqlens_q, cu_seqlens_k, optional, dq, dk, dv,
                        dsinks, dq_accum, dpsum, lse_log2, has_dlse, has_seqused_k, has_seqused_q, has_sinks, softcap,
                        softmax_scale, window_left, window_right, &mask_bits, &tile_classes);
}

// Whether a tangent (or an output) is shaped like its primal: same dtype, element count and rank (the kernels read it
// with the primal's strides).
bool shaped_like(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  return a.element_type() == b.element_type() && a.element_count() == b.element_count() &&
         a.dimensions().size() == b.dimensions().size();
}

// sinks and their tangent ([Hq] f32), both or neither as has_sinks says, the last optional operands of the dense
// tangent and fused jvp targets.
template <typename Params>
ffi::Error take_sinks_and_tangents(const ffi::RemainingArgs& optional, bool has_sinks, Params& p) {
  OptionalOperands slots(optional, 2);
  if (auto err = slots.take(has_sinks, p.heads_q, "sinks", p.sinks); err.failure()) return err;
  if (auto err = slots.take(has_sinks, p.heads_q, "tsinks", p.tsinks); err.failure()) return err;
  return slots.finish();
}

// Whether an output XLA allocates is shaped like q: same dtype and element count.
bool sized_like(const ffi::Result<ffi::AnyBuffer>& out, const ffi::AnyBuffer& q) {
  return out->element_type() == q.element_type() && out->element_count() == q.element_count();
}

// What the tangent targets and the fused jvp share once the shape is filled: each tangent shaped like its primal,
// t_out like q and t_lse one value per query row, and the pointers of q, k, v, the tangents, t_out and t_lse. o and
// lse are the tangent's inputs but the jvp's outputs: each caller checks and sets its own.
template <typename Params>
bool fill_tangent_pointers(Params& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                           const ffi::AnyBuffer& tq, const ffi::AnyBuffer& tk, const ffi::AnyBuffer& tv,
                           ffi::Result<ffi::AnyBuffer>& t_out, ffi::Result<ffi::Buffer<ffi::F32>>& t_lse) {
  if (!shaped_like(tq, q) || !shaped_like(tk, k) || !shaped_like(tv, v) || !sized_like(t_out, q) ||
      t_lse->element_count() != static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q) {
    return false;
  }
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.tq = tq.untyped_data();
  p.tk = tk.untyped_data();
  p.tv = tv.untyped_data();
  p.t_out = t_out->untyped_data();
  p.t_lse = t_lse->typed_data();
  return true;
}

// Both tangent targets' operands (fill_tangent_pointers, then o like q and lse one value per query row). lse_shape
// names the layout for the error ("[B, Hq, Sq]", varlen's "[Hq, Tq]").
ffi::Error fill_tangent_operands(TangentParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                 const ffi::AnyBuffer& v, const ffi::AnyBuffer& o, ffi::Buffer<ffi::F32>& lse,
                                 const ffi::AnyBuffer& tq, const ffi::AnyBuffer& tk, const ffi::AnyBuffer& tv,
                                 ffi::Result<ffi::AnyBuffer>& t_out, ffi::Result<ffi::Buffer<ffi::F32>>& t_lse,
                                 const char* lse_shape) {
  // lse against t_lse, whose count fill_tangent_pointers checked.
  if (!fill_tangent_pointers(p, q, k, v, tq, tk, tv, t_out, t_lse) || !shaped_like(o, q) ||
      lse.element_count() != t_lse->element_count()) {
    return invalid("tangent operands must be shaped like their primals: o, tq and t_out like q " +
                   dims_str(q.dimensions()) + ", tk like k, tv like v, lse and t_lse " + lse_shape);
  }
  p.o = o.untyped_data();
  p.lse = lse.typed_data();
  return ffi::Error::Success();
}

// The tangent (jax.jvp, issue 39): q, k, v, the forward's o and lse, the tangents tq, tk, tv, then sinks and their
// tangent when has_sinks (both or neither) -> t_out, t_lse. mask_bits / tile_classes: the mask-mod target's (nullptr:
// the plain one).
ffi::Error run_tangent(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer o, ffi::Buffer<ffi::F32>& lse, ffi::AnyBuffer tq, ffi::AnyBuffer tk,
                       ffi::AnyBuffer tv, const ffi::RemainingArgs& optional, ffi::Result<ffi::AnyBuffer>& t_out,
                       ffi::Result<ffi::Buffer<ffi::F32>>& t_lse, bool has_sinks, float softcap, float softmax_scale,
                       int32_t window_left, int32_t window_right, const ffi::Buffer<ffi::U32>* mask_bits = nullptr,
                       ffi::Result<ffi::Buffer<ffi::U8>>* tile_classes = nullptr) {
  TangentParams p;
  if (auto err = fill_shape(p, q, k, v, softmax_scale, softcap, window_left, window_right); err.failure()) {
    return err;
  }
  if (auto err = fill_tangent_operands(p, q, k, v, o, lse, tq, tk, tv, t_out, t_lse, "[B, Hq, Sq]"); err.failure()) {
    return err;
  }
  if (auto err = take_sinks_and_tangents(optional, has_sinks, p); err.failure()) return err;
  if (mask_bits != nullptr) {
    if (auto err = fill_mask_bits(p, *mask_bits); err.failure()) return err;
  }
  const PassPlan plan = plan_for(ordinal, Direction::kTangent, p, has_sinks, /*num_splits=*/1, /*explain=*/false);
  if (plan.kernel != nullptr && tile_classes != nullptr) {
    if (auto err = take_mask_tile_classes(p, plan, *tile_classes); err.failure()) return err;
  }
  return launch(plan, p, stream);
}

ffi::Error tangent_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer tq, ffi::AnyBuffer tk,
                        ffi::AnyBuffer tv, ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> t_out,
                        ffi::Result<ffi::Buffer<ffi::F32>> t_lse, bool has_sinks, float softcap, float softmax_scale,
                        int32_t window_left, int32_t window_right) {
  return run_tangent(stream, ordinal, q, k, v, o, lse, tq, tk, tv, optional, t_out, t_lse, has_sinks, softcap,
                     softmax_scale, window_left, window_right);
}

// The tangent with a mask mod (issue 39; a separate target, so that the plain one keeps the signature exported calls
// were lowered with): the tangent's required operands, the forward's mask bits, then sinks and tsinks as has_sinks
// says; t_out, t_lse and the tile-class workspace (block lists ahead of the classes where the kernel walks them),
// sized by the plan for the tangent kernel's own tiles.
ffi::Error tangent_mask_mod_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer tq,
                                 ffi::AnyBuffer tk, ffi::AnyBuffer tv, ffi::Buffer<ffi::U32> mask_bits,
                                 ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> t_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> t_lse,
                                 ffi::Result<ffi::Buffer<ffi::U8>> tile_classes, bool has_sinks, float softcap,
                                 float softmax_scale, int32_t window_left, int32_t window_right) {
  return run_tangent(stream, ordinal, q, k, v, o, lse, tq, tk, tv, optional, t_out, t_lse, has_sinks, softcap,
                     softmax_scale, window_left, window_right, &mask_bits, &tile_classes);
}

// The varlen tangent: the tangent's operands in fill_varlen_shape's shapes (lse, t_lse [Hq, Tq]), the offsets, then
// the optional seqused_q, seqused_k ([N] int32), sinks and tsinks ([Hq] f32) as their flags say.
ffi::Error tangent_varlen_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer tq,
                               ffi::AnyBuffer tk, ffi::AnyBuffer tv, ffi::Buffer<ffi::S32> cu_seqlens_q,
                               ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::RemainingArgs optional,
                               ffi::Result<ffi::AnyBuffer> t_out, ffi::Result<ffi::Buffer<ffi::F32>> t_lse,
                               bool has_seqused_k, bool has_seqused_q, bool has_sinks, float softcap,
                               float softmax_scale, int32_t window_left, int32_t window_right) {
  TangentParams p;
  if (auto err = fill_varlen_shape(p, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, softcap, window_left,
                                   window_right);
      err.failure()) {
    return err;
  }
  if (auto err = fill_tangent_operands(p, q, k, v, o, lse, tq, tk, tv, t_out, t_lse, "[Hq, Tq]"); err.failure()) {
    return err;
  }
  OptionalOperands slots(optional, 4);
  const size_t n = static_cast<size_t>(p.num_seqs);
  if (auto err = slots.take<ffi::S32>(has_seqused_q, n, "seqused_q", p.seqused_q); err.failure()) return err;
  if (auto err = slots.take<ffi::S32>(has_seqused_k, n, "seqused_k", p.seqused_k); err.failure()) return err;
  if (auto err = slots.take(has_sinks, p.heads_q, "sinks", p.sinks); err.failure()) return err;
  if (auto err = slots.take(has_sinks, p.heads_q, "tsinks", p.tsinks); err.failure()) return err;
  if (auto err = slots.finish(); err.failure()) return err;
  const PassPlan plan = plan_for(ordinal, Direction::kTangent, p, has_sinks, /*num_splits=*/1, /*explain=*/false);
  return launch(plan, p, stream);
}

// The fused jvp (jax.jvp's primal and tangent in one kernel, issue 39): q, k, v, the tangents tq, tk, tv, then sinks
// and their tangent when has_sinks (both or neither) -> out, lse (the forward's), t_out, t_lse (the tangent's).
ffi::Error jvp_impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer tq, ffi::AnyBuffer tk, ffi::AnyBuffer tv, ffi::RemainingArgs optional,
                    ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                    ffi::Result<ffi::AnyBuffer> t_out, ffi::Result<ffi::Buffer<ffi::F32>> t_lse, bool has_sinks,
                    float softcap, float softmax_scale, int32_t window_left, int32_t window_right) {
  JvpParams p;
  if (auto err = fill_shape(p, q, k, v, softmax_scale, softcap, window_left, window_right); err.failure()) {
    return err;
  }
  // lse against t_lse, whose count fill_tangent_pointers checked.
  if (!fill_tangent_pointers(p, q, k, v, tq, tk, tv, t_out, t_lse) || !sized_like(o, q) ||
      lse->element_count() != t_lse->element_count()) {
    return invalid("jvp operands must be shaped like their primals: tq, out and t_out like q " +
                   dims_str(q.dimensions()) + ", tk like k, tv like v, lse and t_lse [B, Hq, Sq]");
  }
  if (auto err = take_sinks_and_tangents(optional, has_sinks, p); err.failure()) return err;
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  const PassPlan plan = plan_for(ordinal, Direction::kJvp, p, has_sinks, /*num_splits=*/1, /*explain=*/false);
  return launch(plan, p, stream);
}

// What every target binds first: the stream, the device and q, k, v.
auto qkv_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()   // q
      .Arg<ffi::AnyBuffer>()   // k
      .Arg<ffi::AnyBuffer>();  // v
}

// q, k, v and the tangent's other required operands, which both tangent targets bind first.
auto tangent_operands() {
  return qkv_binding()
      .Arg<ffi::AnyBuffer>()          // o
      .Arg<ffi::Buffer<ffi::F32>>()   // lse
      .Arg<ffi::AnyBuffer>()          // tq
      .Arg<ffi::AnyBuffer>()          // tk
      .Arg<ffi::AnyBuffer>();         // tv
}

// q, k, v and the backward's other required operands, which every backward target binds first.
auto bwd_operands() {
  return qkv_binding()
      .Arg<ffi::AnyBuffer>()          // o
      .Arg<ffi::Buffer<ffi::F32>>()   // lse
      .Arg<ffi::AnyBuffer>();         // dout
}

// After a backward target's required operands: the optional ones, the gradients and the f32 workspace.
template <typename Binding>
auto with_bwd_results(Binding binding) {
  return std::move(binding)
      .RemainingArgs()                         // optional operands (see OptionalOperands)
      .template Ret<ffi::AnyBuffer>()          // dq
      .template Ret<ffi::AnyBuffer>()          // dk
      .template Ret<ffi::AnyBuffer>()          // dv
      .template Ret<ffi::Buffer<ffi::F32>>()   // dsinks [Hq]
      .template Ret<ffi::Buffer<ffi::F32>>()   // workspace: dq_accum
      .template Ret<ffi::Buffer<ffi::F32>>()   // workspace: dpsum
      .template Ret<ffi::Buffer<ffi::F32>>();  // workspace: lse_log2
}

// What both dense backward targets bind first: the operands (optional: dlse, sinks), the gradients, the workspace.
auto bwd_binding() { return with_bwd_results(bwd_operands()); }

// The attributes every target but the split forward binds last (after any of its own that sort first), in name
// order, as XLA passes them.
template <typename Binding>
auto with_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<bool>("has_sinks")
      .template Attr<float>("softcap")
      .template Attr<float>("softmax_scale")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right");
}

// The attributes both backward targets bind after their results (in name order, as XLA passes them).
template <typename Binding>
auto with_bwd_attrs(Binding binding) {
  return with_attrs(std::move(binding).template Attr<bool>("has_dlse"));
}

// The attributes both varlen targets bind after their results and any of their own that sort first (has_dlse), in
// name order.
template <typename Binding>
auto with_varlen_attrs(Binding binding) {
  return with_attrs(std::move(binding).template Attr<bool>("has_seqused_k").template Attr<bool>("has_seqused_q"));
}

// What both forward targets bind first: context, q, k, v, the optional operands, o and lse.
auto fwd_binding() {
  return qkv_binding()
      .RemainingArgs()               // sinks [Hq] f32 (see OptionalOperands)
      .Ret<ffi::AnyBuffer>()         // o
      .Ret<ffi::Buffer<ffi::F32>>();  // lse [B, Hq, Sq]
}

}  // namespace
}  // namespace flashjax

// The handler symbols are the library's interface: visible despite -fvisibility=hidden (exports.map keeps only
// flashjax_*). Attributes are bound in name order, the order XLA passes them in.
#pragma GCC visibility push(default)
XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_fwd, flashjax::fwd_impl,
                              flashjax::with_attrs(flashjax::fwd_binding()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_fwd_mask_mod, flashjax::fwd_mask_mod_impl,
                              flashjax::with_attrs(flashjax::qkv_binding()
                                  .Arg<ffi::Buffer<ffi::U32>>()     // mask_bits [Bm, Hm, Sq, Wk]
                                  .RemainingArgs()                  // sinks [Hq] f32 (see OptionalOperands)
                                  .Ret<ffi::AnyBuffer>()            // o
                                  .Ret<ffi::Buffer<ffi::F32>>()     // lse [B, Hq, Sq]
                                  .Ret<ffi::Buffer<ffi::U8>>()),    // workspace: mask_tile_classes
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_fwd_split, flashjax::fwd_split_impl,
                              flashjax::fwd_binding()
                                  .Ret<ffi::Buffer<ffi::F32>>()     // workspace: o_partial [B, splits, Hq, Sq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // workspace: lse_partial [B, splits, Hq, Sq]
                                  .Attr<bool>("has_sinks")
                                  .Attr<int32_t>("num_splits")
                                  .Attr<float>("softcap")
                                  .Attr<float>("softmax_scale")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_fwd_varlen, flashjax::fwd_varlen_impl,
                              flashjax::with_varlen_attrs(flashjax::qkv_binding()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_q [N + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_k [N + 1]
                                  .RemainingArgs()                // seqused_q, seqused_k [N] int32; sinks [Hq] f32
                                  .Ret<ffi::AnyBuffer>()          // o [Tq, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()),  // lse [Hq, Tq]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_fwd_varlen_dynamic, flashjax::fwd_varlen_dynamic_impl,
                              flashjax::with_varlen_attrs(flashjax::qkv_binding()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_q [N + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_k [N + 1]
                                  .RemainingArgs()                // seqused_q, seqused_k [N] int32; sinks [Hq] f32
                                  .Ret<ffi::AnyBuffer>()          // o [Tq, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse [Hq, Tq]
                                  .Ret<ffi::Buffer<ffi::S32>>()),  // workspace: tile_counter
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_tangent, flashjax::tangent_impl,
                              flashjax::with_attrs(flashjax::tangent_operands()
                                  .RemainingArgs()                // sinks, tsinks [Hq] f32 (see OptionalOperands)
                                  .Ret<ffi::AnyBuffer>()          // t_out
                                  .Ret<ffi::Buffer<ffi::F32>>()),  // t_lse [B, Hq, Sq]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_tangent_mask_mod, flashjax::tangent_mask_mod_impl,
                              flashjax::with_attrs(flashjax::tangent_operands()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // mask_bits [Bm, Hm, Sq, Wk]
                                  .RemainingArgs()                // sinks, tsinks [Hq] f32 (see OptionalOperands)
                                  .Ret<ffi::AnyBuffer>()          // t_out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // t_lse [B, Hq, Sq]
                                  .Ret<ffi::Buffer<ffi::U8>>()),  // workspace: mask_tile_classes
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_tangent_varlen, flashjax::tangent_varlen_impl,
                              flashjax::with_varlen_attrs(flashjax::tangent_operands()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_q [N + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_k [N + 1]
                                  .RemainingArgs()                // seqused_q, seqused_k [N] int32; sinks, tsinks
                                  .Ret<ffi::AnyBuffer>()          // t_out [Tq, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()),  // t_lse [Hq, Tq]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_jvp, flashjax::jvp_impl,
                              flashjax::with_attrs(flashjax::qkv_binding()
                                  .Arg<ffi::AnyBuffer>()          // tq
                                  .Arg<ffi::AnyBuffer>()          // tk
                                  .Arg<ffi::AnyBuffer>()          // tv
                                  .RemainingArgs()                // sinks, tsinks [Hq] f32 (see OptionalOperands)
                                  .Ret<ffi::AnyBuffer>()          // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse [B, Hq, Sq]
                                  .Ret<ffi::AnyBuffer>()          // t_out
                                  .Ret<ffi::Buffer<ffi::F32>>()),  // t_lse [B, Hq, Sq]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_bwd, flashjax::bwd_impl, flashjax::with_bwd_attrs(flashjax::bwd_binding()),
                              {ffi::Traits::kCmdBufferCompatible});

// Optional operands: seqused_q, seqused_k [N] int32, dlse [Hq, Tq], sinks [Hq]; workspace [Hq, rows(, D)].
XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_bwd_varlen, flashjax::bwd_varlen_impl,
                              flashjax::with_varlen_attrs(
                                  flashjax::with_bwd_results(flashjax::bwd_operands()
                                                                 .Arg<ffi::Buffer<ffi::S32>>()    // cu_seqlens_q
                                                                 .Arg<ffi::Buffer<ffi::S32>>())   // cu_seqlens_k
                                      .Attr<bool>("has_dlse")),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_bwd_mask_mod, flashjax::bwd_mask_mod_impl,
                              flashjax::with_bwd_attrs(
                                  flashjax::with_bwd_results(
                                      flashjax::bwd_operands().Arg<ffi::Buffer<ffi::U32>>())  // mask_bits
                                      .Ret<ffi::Buffer<ffi::U8>>()),  // workspace: mask_tile_classes
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_bwd_mask_mod_deterministic, flashjax::bwd_mask_mod_deterministic_impl,
                              flashjax::with_bwd_attrs(
                                  flashjax::with_bwd_results(
                                      flashjax::bwd_operands().Arg<ffi::Buffer<ffi::U32>>())  // mask_bits
                                      .Ret<ffi::Buffer<ffi::S32>>()   // workspace: dq_semaphore
                                      .Ret<ffi::Buffer<ffi::U8>>()),  // workspace: mask_tile_classes
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_fwd_varlen_mask_mod, flashjax::fwd_varlen_mask_mod_impl,
                              flashjax::with_varlen_attrs(flashjax::qkv_binding()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_q [N + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens_k [N + 1]
                                  .Arg<ffi::Buffer<ffi::U32>>()   // mask_bits [1 or N, 1 or Hq, max_seqlen_q, Wk]
                                  .RemainingArgs()                // seqused_q, seqused_k [N] int32; sinks [Hq] f32
                                  .Ret<ffi::AnyBuffer>()          // o [Tq, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse [Hq, Tq]
                                  .Ret<ffi::Buffer<ffi::U8>>()),  // workspace: mask_tile_classes
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_bwd_varlen_mask_mod, flashjax::bwd_varlen_mask_mod_impl,
                              flashjax::with_varlen_attrs(
                                  flashjax::with_bwd_results(flashjax::bwd_operands()
                                                                 .Arg<ffi::Buffer<ffi::S32>>()    // cu_seqlens_q
                                                                 .Arg<ffi::Buffer<ffi::S32>>()    // cu_seqlens_k
                                                                 .Arg<ffi::Buffer<ffi::U32>>())   // mask_bits
                                      .Ret<ffi::Buffer<ffi::U8>>()  // workspace: mask_tile_classes
                                      .Attr<bool>("has_dlse")),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_bwd_deterministic, flashjax::bwd_deterministic_impl,
                              flashjax::with_bwd_attrs(
                                  flashjax::bwd_binding().Ret<ffi::Buffer<ffi::S32>>()),  // workspace: dq_semaphore
                              {ffi::Traits::kCmdBufferCompatible});
#pragma GCC visibility pop

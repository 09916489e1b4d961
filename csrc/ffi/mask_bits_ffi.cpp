// The XLA FFI target flashjax_mask_bits: runs a mask mod's mask-bits kernel (python/flashjax/mask_bits.py,
// docs/mask_codegen.md), which writes the packed bitmask [Bm, Hm, Sq, ceil(Sk / 32)] uint32 the attention kernels
// read.
//
// The kernel is NVRTC output for one mod's generated source; it travels in the call as the `binary` attribute (a
// cubin for the lowering GPU's arch, or PTX), so a jax.export artifact carries it. The instantiate stage loads it
// into per-instance state (context-independent: cudaLibraryLoadData, no device needed); execute only fills the
// fields' descriptor from its operand buffers and launches on XLA's stream, so it is command-buffer compatible.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashjax {
namespace {

// The kernel's launch shape and field layout: python/flashjax/mask_emit.py (BITS_BLOCK_THREADS,
// BITS_ROWS_PER_WARP, ABI_SOURCE's FlashjaxMaskFields) emits the device side of the same numbers.
constexpr int kBlockThreads = 128;
constexpr int kRowsPerWarp = 16;
constexpr int kWarpsPerBlock = kBlockThreads / 32;
constexpr int kMaxFields = 8;
constexpr int kMaxFieldRank = 4;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // the warps loop over tasks, so a capped grid covers any size

struct MaskField {
  const int* data;
  long long stride[kMaxFieldRank];  // elements; 0 on an axis past the field's rank
  int extent[kMaxFieldRank];        // 1 on an axis past the field's rank
};
struct MaskFields {
  MaskField field[kMaxFields];
};
static_assert(sizeof(MaskField) == 56 && sizeof(MaskFields) == 448, "must match mask_emit.ABI_SOURCE");

// The loaded kernel of one call site; XLA owns it and destroys it with the executable.
struct MaskBitsState {
  static ffi::TypeId id;
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernel = nullptr;
  ~MaskBitsState() {
    if (library != nullptr) cudaLibraryUnload(library);  // at process exit the driver may be gone: ignored
  }
};
ffi::TypeId MaskBitsState::id = {};

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("flashjax_mask_bits: " + what);
}

// The sizes every stage checks: the kernel's index arithmetic stays in int (q0 + rows, 32 * words + 31, b * heads).
ffi::Error check_sizes(int32_t batch, int32_t heads, int32_t seqlen_q, int32_t seqlen_k) {
  if (batch < 1 || heads < 1 || int64_t{batch} * heads > INT_MAX) {
    return invalid("batch and heads must be >= 1 with batch * heads < 2^31, got batch " + std::to_string(batch) +
                   ", heads " + std::to_string(heads));
  }
  if (seqlen_q < 0 || seqlen_q > INT_MAX - kRowsPerWarp) {
    return invalid("seqlen_q must be in [0, 2^31 - 17], got " + std::to_string(seqlen_q));
  }
  if (seqlen_k < 0 || seqlen_k > INT_MAX - 31) {
    return invalid("seqlen_k must be in [0, 2^31 - 32], got " + std::to_string(seqlen_k));
  }
  return ffi::Error::Success();
}

// field_shapes = [n, then per field: rank, d0, d1, d2, d3 (1 past the rank)]: what the lowering traced the mod with.
ffi::Error check_field_shapes(ffi::Span<const int64_t> shapes) {
  if (shapes.size() < 1 || shapes[0] < 0 || shapes[0] > kMaxFields ||
      shapes.size() != 1 + static_cast<size_t>(shapes[0]) * (1 + kMaxFieldRank)) {
    return invalid("field_shapes must be [n <= " + std::to_string(kMaxFields) + ", then rank and " +
                   std::to_string(kMaxFieldRank) + " dims per field], got " + std::to_string(shapes.size()) +
                   " values");
  }
  for (int64_t k = 0; k < shapes[0]; ++k) {
    const int64_t* spec = shapes.begin() + 1 + k * (1 + kMaxFieldRank);
    if (spec[0] < 0 || spec[0] > kMaxFieldRank) {
      return invalid("field " + std::to_string(k) + " has rank " + std::to_string(spec[0]) + ", expected <= " +
                     std::to_string(kMaxFieldRank));
    }
    for (int d = 0; d < kMaxFieldRank; ++d) {
      if (spec[1 + d] < 0 || spec[1 + d] > INT_MAX) {
        return invalid("field " + std::to_string(k) + " axis " + std::to_string(d) + " has extent " +
                       std::to_string(spec[1 + d]) + ", expected [0, 2^31)");
      }
    }
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<MaskBitsState>> mask_bits_instantiate(
    int32_t batch, ffi::Span<const uint8_t> binary, ffi::Span<const int64_t> field_shapes, int32_t heads,
    std::string_view kernel_name, int32_t seqlen_k, int32_t seqlen_q) {
  if (auto err = check_sizes(batch, heads, seqlen_q, seqlen_k); err.failure()) return ffi::Unexpected(err);
  if (auto err = check_field_shapes(field_shapes); err.failure()) return ffi::Unexpected(err);
  if (binary.size() == 0) return ffi::Unexpected(invalid("binary is empty, expected NVRTC's cubin or PTX"));
  if (kernel_name.empty()) return ffi::Unexpected(invalid("kernel_name is empty"));
  // PTX must be NUL-terminated; a cubin does not mind the extra byte. The library keeps what it needs.
  const std::string code(reinterpret_cast<const char*>(binary.begin()), binary.size());
  auto state = std::make_unique<MaskBitsState>();
  cudaError_t err = cudaLibraryLoadData(&state->library, code.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (err != cudaSuccess) {
    state->library = nullptr;
    return ffi::Unexpected(ffi::Error::Internal(std::string("flashjax_mask_bits: loading the mask-bits binary (") +
                                                std::to_string(binary.size()) + " bytes) failed: " +
                                                cudaGetErrorString(err)));
  }
  const std::string name(kernel_name);
  err = cudaLibraryGetKernel(&state->kernel, state->library, name.c_str());
  if (err != cudaSuccess) {
    return ffi::Unexpected(ffi::Error::Internal("flashjax_mask_bits: the binary has no kernel " + name + ": " +
                                                cudaGetErrorString(err)));
  }
  // Load it into the current device's context now, if the thread has one, rather than lazily at the first launch,
  // which may be under CUDA graph capture. Other devices still load at their first launch; a failure here only
  // means no current context, so it is cleared, not reported.
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(state->kernel)) != cudaSuccess) {
    cudaGetLastError();
  }
  return state;
}

// Fills field k's descriptor from its buffer, which must be int32 of the traced shape (row-major, as XLA passes it).
ffi::Error fill_field(MaskField& field, const ffi::RemainingArgs& operands, int64_t k, const int64_t* spec) {
  auto buffer = operands.get<ffi::AnyBuffer>(k);
  if (buffer.has_error()) return invalid("field operand " + std::to_string(k) + " could not be read");
  if (buffer->element_type() != ffi::DataType::S32) {
    return invalid("field operand " + std::to_string(k) + " must be int32 (mask_field_operands)");
  }
  const auto dims = buffer->dimensions();
  bool same = static_cast<int64_t>(dims.size()) == spec[0];
  for (size_t d = 0; same && d < dims.size(); ++d) same = dims[d] == spec[1 + d];
  if (!same) {
    auto text = [](const int64_t* values, size_t n) {
      std::string out = "[";
      for (size_t d = 0; d < n; ++d) out += (d ? ", " : "") + std::to_string(values[d]);
      return out + "]";
    };
    return invalid("field operand " + std::to_string(k) + " has shape " + text(dims.begin(), dims.size()) +
                   ", expected the traced " + text(spec + 1, static_cast<size_t>(spec[0])));
  }
  field.data = static_cast<const int*>(buffer->untyped_data());
  long long stride = 1;
  for (int d = kMaxFieldRank - 1; d >= 0; --d) {
    const bool real = d < spec[0];
    field.extent[d] = real ? static_cast<int>(spec[1 + d]) : 1;
    field.stride[d] = real ? stride : 0;
    stride *= field.extent[d];
  }
  return ffi::Error::Success();
}

ffi::Error mask_bits_execute(cudaStream_t stream, MaskBitsState* state, ffi::RemainingArgs operands,
                             ffi::Result<ffi::Buffer<ffi::U32>> bits, int32_t batch, ffi::Span<const uint8_t>,
                             ffi::Span<const int64_t> field_shapes, int32_t heads, std::string_view,
                             int32_t seqlen_k, int32_t seqlen_q) {
  if (state == nullptr || state->kernel == nullptr) return invalid("the instantiate stage loaded no kernel");
  if (auto err = check_sizes(batch, heads, seqlen_q, seqlen_k); err.failure()) return err;
  if (auto err = check_field_shapes(field_shapes); err.failure()) return err;
  if (static_cast<int64_t>(operands.size()) != field_shapes[0]) {
    return invalid("expected " + std::to_string(field_shapes[0]) + " field operands, got " +
                   std::to_string(operands.size()));
  }
  const int32_t words = seqlen_k / 32 + (seqlen_k % 32 != 0);
  const auto out_dims = bits->dimensions();
  if (out_dims.size() != 4 || out_dims[0] != batch || out_dims[1] != heads || out_dims[2] != seqlen_q ||
      out_dims[3] != words) {
    return invalid("the result must be uint32 [batch, heads, seqlen_q, ceil(seqlen_k / 32)] = [" +
                   std::to_string(batch) + ", " + std::to_string(heads) + ", " + std::to_string(seqlen_q) + ", " +
                   std::to_string(words) + "]");
  }
  MaskFields fields = {};  // unused slots: null data and zero extents, which the predicate never reads
  for (int64_t k = 0; k < field_shapes[0]; ++k) {
    if (auto err = fill_field(fields.field[k], operands, k, field_shapes.begin() + 1 + k * (1 + kMaxFieldRank));
        err.failure()) {
      return err;
    }
  }
  if (seqlen_q == 0 || words == 0) return ffi::Error::Success();  // an empty bitmask: nothing to launch
  const int64_t chunks = (words + 31) / 32;
  const int64_t row_groups = (seqlen_q + int64_t{kRowsPerWarp} - 1) / kRowsPerWarp;
  const int64_t tasks = int64_t{batch} * heads * row_groups * chunks;
  const int64_t blocks = std::min<int64_t>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
  unsigned int* out = bits->typed_data();
  void* args[] = {&fields, &batch, &heads, &seqlen_q, &seqlen_k, &out};
  const cudaError_t err = cudaLaunchKernel(reinterpret_cast<const void*>(state->kernel),
                                           dim3(static_cast<unsigned>(blocks)), dim3(kBlockThreads), args, 0,
                                           stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("flashjax_mask_bits: kernel launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// Both stages bind every attribute, in name order (the order XLA passes them in).
template <typename Binding>
auto with_mask_bits_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<int32_t>("batch")                      // Bm
      .template Attr<ffi::Span<const uint8_t>>("binary")    // NVRTC's cubin or PTX
      .template Attr<ffi::Span<const int64_t>>("field_shapes")
      .template Attr<int32_t>("heads")                      // Hm
      .template Attr<std::string_view>("kernel_name")
      .template Attr<int32_t>("seqlen_k")
      .template Attr<int32_t>("seqlen_q");
}

const XLA_FFI_TypeInfo kMaskBitsStateInfo = ffi::MakeTypeInfo<MaskBitsState>();

}  // namespace
}  // namespace flashjax

#pragma GCC visibility push(default)
// The state's type, which Python registers (jax.ffi.register_ffi_type) before the target.
extern "C" XLA_FFI_TypeId* flashjax_mask_bits_state_type_id() { return &flashjax::MaskBitsState::id; }
extern "C" const XLA_FFI_TypeInfo* flashjax_mask_bits_state_type_info() { return &flashjax::kMaskBitsStateInfo; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_mask_bits_instantiate, flashjax::mask_bits_instantiate,
                              flashjax::with_mask_bits_attrs(ffi::Ffi::BindInstantiate()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(flashjax_mask_bits_execute, flashjax::mask_bits_execute,
                              flashjax::with_mask_bits_attrs(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                      .Ctx<ffi::State<flashjax::MaskBitsState>>()
                                      .RemainingArgs()                      // the mod's fields, int32
                                      .Ret<ffi::Buffer<ffi::U32>>()),       // the bitmask
                              {ffi::Traits::kCmdBufferCompatible});
#pragma GCC visibility pop

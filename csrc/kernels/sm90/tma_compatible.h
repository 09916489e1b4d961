// Whether TMA can address a [B, S, H, D] tensor, shared by the sm90 launchers.
#pragma once

#include <cstdint>

namespace flashjax::sm90::detail {

// TMA addresses 16-byte aligned global memory with strides that are multiples of 16 bytes below 2^40 bytes
// (cuTensorMapEncodeTiled). The Python layer's contiguous [B, S, H, D] arrays always qualify; anything else is
// refused here rather than failing an assert inside CUTLASS's descriptor builder.
template <typename Element>
inline bool tma_compatible(const void* ptr, int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
  constexpr int64_t kBytes = sizeof(Element);
  auto ok = [](int64_t stride_bytes) {
    return stride_bytes >= 0 && stride_bytes % 16 == 0 && stride_bytes < (int64_t(1) << 40);
  };
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && ok(row_stride * kBytes) && ok(head_stride * kBytes) &&
         ok(batch_stride * kBytes);
}

}  // namespace flashjax::sm90::detail

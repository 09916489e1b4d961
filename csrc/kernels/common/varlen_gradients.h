// The varlen backward's gradient rows that no CTA writes (keys and query rows past seqused, tokens outside every
// sequence, rows that malformed offsets leave out) are zero, as the reference gives unused rows: stream-ordered
// memsets of dq, dk, dv before the kernels, which then overwrite the rows of their sequences (rows of [T, H, D] with
// the handler's strides). Both families' backward launchers (sm80/bwd_launch.cuh, sm90/bwd_launch.cuh) use it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "flashjax/params.h"

namespace flashjax::common {

template <typename Element>
cudaError_t zero_varlen_gradients(const BwdParams& params, cudaStream_t stream) {
  const std::pair<void*, int64_t> tensors[] = {{params.dq, int64_t(params.seqlen_q) * params.dq_row_stride},
                                               {params.dk, int64_t(params.seqlen_k) * params.dk_row_stride},
                                               {params.dv, int64_t(params.seqlen_k) * params.dv_row_stride}};
  for (const auto& [data, elements] : tensors) {
    if (elements <= 0) continue;
    const cudaError_t err = cudaMemsetAsync(data, 0, size_t(elements) * sizeof(Element), stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace flashjax::common

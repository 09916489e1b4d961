// Layout of the f32 dQ workspace (BwdParams::dq_accum) inside one (batch, head) slab of Sq_rounded * D floats, shared
// by the main kernel (atomic adds) and the postprocess (reads). The preprocess zeroes whole slabs, so it does not care.
//
// The slab is a sequence of M blocks of kBlockM * D floats (kBwdSeqlenQRounding is a multiple of kBlockM), each a
// sequence of kDqChunks chunks of kBlockM * kDqCols floats, one per dQ = dS K pass. A chunk is stored in the register
// order of the TiledMmaDq accumulator, not row-major: value i of thread t sits at ((i / 4) * kNThreads + t) * 4 + i % 4.
// A warp's atomic then covers 512 contiguous bytes (four whole 128-byte lines, one 16-byte red.global.add.v4.f32 per
// lane on sm90+) where the row-major layout scattered each instruction over 8 rows (8 lines, 8-byte pieces): 4x fewer
// L2 requests and half the instructions for the same bytes. The postprocess reads it back with the same map.
#pragma once

#include <cute/tensor.hpp>

#include "flashjax/params.h"

namespace flashjax::sm80 {

inline constexpr int kDqAccumVec = 4;  // floats per thread per access (one float4)

template <typename Layouts>
__host__ __device__ constexpr int dq_accum_offset(int value, int thread) {
  return ((value / kDqAccumVec) * Layouts::kNThreads + thread) * kDqAccumVec + value % kDqAccumVec;
}

// First float of the M block starting at row slab_row (a multiple of kBlockM: m_block * kBlockM, plus the sequence's
// ws_start in varlen), chunk `chunk`, in the slab of (batch, head).
template <typename Layouts>
__device__ __forceinline__ int64_t dq_accum_chunk_start(const BwdParams& params, int batch, int head, int slab_row,
                                                        int chunk) {
  constexpr int kBlockM = Layouts::kBlockM;
  return ((int64_t(batch) * params.heads_q + head) * params.seqlen_q_rounded + slab_row) * Layouts::kHeadDim +
         chunk * kBlockM * Layouts::kDqCols;
}

// chunk_accum += acc_dq, the calling thread's TiledMmaDq fragment of one chunk. Coalesced: see the file comment.
template <typename Layouts, typename AccDq>
__device__ __forceinline__ void atomic_add_dq_chunk(float* chunk_accum, const AccDq& acc_dq) {
  using namespace cute;
  static_assert(decltype(size(acc_dq))::value % kDqAccumVec == 0);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += kDqAccumVec) {
    float* dst = chunk_accum + dq_accum_offset<Layouts>(i, threadIdx.x);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(dst), make_float4(acc_dq(i), acc_dq(i + 1), acc_dq(i + 2), acc_dq(i + 3)));
#else
    CUTE_UNROLL
    for (int j = 0; j < kDqAccumVec; ++j) atomicAdd(dst + j, acc_dq(i + j));
#endif
  }
}

}  // namespace flashjax::sm80

// Which rows each CTA of the sm80 backward's three passes owns, dense or varlen (packed sequences, docs/design.md
// §2.7). The row passes of the sm90 backward use it too (bwd_preprocess.cuh).
//
//   main kernel   grid (KV block, Hk, B); varlen (Tk / kBlockN + N virtual KV blocks, Hk, 1), a CTA finding its
//                 sequence by binary search over cu_seqlens_k (kernels/common/varlen.cuh)
//   postprocess   grid (M block, Hq, B); varlen (Tq / kBlockM + N virtual M blocks, Hq, 1), likewise over cu_seqlens_q
//   preprocess    every row of every workspace slab (bwd_row_of_slab_row)
//
// Varlen places sequence b's rows in each head's workspace slab from unit varlen_first_block<kBwdVarlenRowBlock>(b)
// on (flashjax/workspace.h), so padded M blocks of different sequences never share workspace rows. Every offset and
// length comes clamped from varlen.cuh: a sequence is always a row range inside the tensors, and inside the slab.
//
// Varlen is a runtime branch of the dense kernels (only the tile's row offsets and lengths differ), not a second
// instantiation: the measured ptxas cost is in bwd_kernel.cuh's comment.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "flashjax/params.h"
#include "flashjax/workspace.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/varlen.cuh"

namespace flashjax::sm80 {

// One sequence as a backward CTA sees it. Dense: batch `batch`'s [Sq] x [Sk]. Varlen: a sequence's used rows, starting
// at rows q_start / k_start of the packed tensors (batch 0: the batch strides are unused) and at row ws_start of each
// head's workspace slab.
struct BwdSequence {
  int batch = 0;
  int q_start = 0, k_start = 0;
  int seqlen_q = 0, seqlen_k = 0;  // used lengths: the band is bottom-right aligned on them (§2.3)
  int ws_start = 0;                // a multiple of kBwdVarlenRowBlock
  int mod_batch = 0;               // a mask mod's b: the batch entry (dense) or the sequence (varlen, mask_grid.h)
};

__device__ __forceinline__ BwdSequence bwd_varlen_sequence(const AttnShape& shape, int seq) {
  const common::VarlenRows q = common::varlen_rows(shape.cu_seqlens_q, shape.seqused_q, seq, shape.seqlen_q);
  const common::VarlenRows k = common::varlen_rows(shape.cu_seqlens_k, shape.seqused_k, seq, shape.seqlen_k);
  const int ws_start =
      common::varlen_first_block<kBwdVarlenRowBlock>(shape.cu_seqlens_q, seq, shape.seqlen_q) * kBwdVarlenRowBlock;
  return {0, q.start, k.start, q.used, k.used, ws_start, seq};
}

// A CTA's block of kBlock rows of one sequence, for one head (kv head in the main kernel, query head in the
// postprocess). block < 0 or block * kBlock >= the sequence's used rows: a varlen virtual block with no work.
struct BwdBlock {
  BwdSequence seq;
  int head;
  int block;
};

// kBlock rows per block along the side that cu_seqlens / seqlen name: keys (the main kernel) or queries (postprocess).
template <int kBlock, bool kKeys>
struct BwdBlockScheduler {
  static dim3 grid(const AttnShape& shape) {
    const int heads = kKeys ? shape.heads_k : shape.heads_q;
    const int total = kKeys ? shape.seqlen_k : shape.seqlen_q;
    if (shape.cu_seqlens_q != nullptr) {
      const int64_t blocks = common::varlen_num_blocks(total, shape.num_seqs, kBlock);
      return dim3(static_cast<unsigned>(blocks <= INT_MAX ? blocks : 0), heads, 1);  // 0: the launch fails, said
    }
    return dim3(common::ceil_div(total, kBlock), heads, shape.batch);
  }

  __device__ static BwdBlock block(const AttnShape& shape) {
    const int head = blockIdx.y;
    if (shape.cu_seqlens_q == nullptr) {
      return {{static_cast<int>(blockIdx.z), 0, 0, shape.seqlen_q, shape.seqlen_k, 0, static_cast<int>(blockIdx.z)},
              head, static_cast<int>(blockIdx.x)};
    }
    const common::VarlenBlock found =
        common::varlen_block<kBlock>(kKeys ? shape.cu_seqlens_k : shape.cu_seqlens_q, shape.num_seqs,
                                     kKeys ? shape.seqlen_k : shape.seqlen_q, static_cast<int>(blockIdx.x));
    return {bwd_varlen_sequence(shape, found.seq), head, found.block};
  }
};

// The preprocess: the row of q / o / lse that row slab_row of a workspace slab stands for, or -1 for a padding row
// (no query: D' = 0 and lse_log2 = +inf there, so the main kernel's P is 0). Dense: that row while < Sq. Varlen:
// slab_row's unit of kBwdVarlenRowBlock rows belongs to the sequence the binary search finds; the row is real when it
// lies in that sequence's used rows. Every slab row is accounted for, rows between sequences included.
__device__ __forceinline__ int bwd_row_of_slab_row(const AttnShape& shape, int slab_row) {
  if (shape.cu_seqlens_q == nullptr) return slab_row < shape.seqlen_q ? slab_row : -1;
  const common::VarlenBlock found = common::varlen_block<kBwdVarlenRowBlock>(
      shape.cu_seqlens_q, shape.num_seqs, shape.seqlen_q, slab_row / kBwdVarlenRowBlock);
  const common::VarlenRows q = common::varlen_rows(shape.cu_seqlens_q, shape.seqused_q, found.seq, shape.seqlen_q);
  const int local = found.block * kBwdVarlenRowBlock + slab_row % kBwdVarlenRowBlock;
  return found.block >= 0 && local < q.used ? q.start + local : -1;
}

}  // namespace flashjax::sm80

// Maps CTAs to (batch, query head, query block) tiles for the sm80-family forward kernel.
//
// The grid is 1-D (x allows 2^31 - 1 CTAs; y and z would cap batch or heads at 65535). Consecutive CTAs walk the
// query blocks of one (batch, head) before moving on, so the CTAs resident at any moment share that head's K/V in
// L2; within a head they go from the last query block to the first, because with a bottom-right aligned causal
// band the last rows see the most keys: the longest tiles start first and the short ones fill the tail.
// Varlen (packed sequences) walks each head's virtual blocks (kernels/common/varlen.cuh) the same way, last first.
//
// Varlen is a runtime branch here, not a compile-time variant of the kernel: only the tile's row offsets and lengths
// differ, the mainloop is the same code. Measured (tools/check_compile.sh sm80 fwd bf16 128, sm_80): the uncapped
// kernel's report is unchanged (255 registers, 172 / 216 bytes spilled, 112 bytes of stack); the capped one spills 8
// bytes more each way (168 / 208, stack 104 -> 112). That is small against a doubled kernel count, so it stays a
// runtime branch; a compile-time variant is the fallback should the H200's timings show a cost.
#pragma once

#include <cstdint>

#include "flashjax/params.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/varlen.cuh"

namespace flashjax::sm80 {

template <int kBlockM>
struct FwdTileScheduler {
  // The tile's (batch, head, query block) and the rows of its sequence: dense, the whole [Sq] x [Sk] of its batch;
  // varlen, sequence `batch`'s used rows, starting at rows q_start / k_start of the packed tensors (batch strides
  // then unused: the kernel indexes batch 0).
  struct Tile {
    int batch;
    int head_q;
    int m_block;  // >= 0; varlen: may lie past the sequence's rows (m_block * kBlockM >= seqlen_q: no work)
    int q_start, k_start;
    int seqlen_q, seqlen_k;
    int mod_batch;  // a mask mod's b: the batch entry (dense) or the sequence (varlen, mask_grid.h)
  };

  // 0 when there is no work (Sq = 0, B = 0, N = 0 or Hq = 0): the launcher must skip the launch.
  static int64_t num_ctas(const AttnShape& shape) {
    if (shape.cu_seqlens_q != nullptr) {
      if (shape.num_seqs <= 0) return 0;
      return common::varlen_num_blocks(shape.seqlen_q, shape.num_seqs, kBlockM) * shape.heads_q;
    }
    return int64_t(common::ceil_div(shape.seqlen_q, kBlockM)) * shape.heads_q * shape.batch;
  }

  __device__ static Tile tile(const AttnShape& shape, int cta) {
    if (shape.cu_seqlens_q != nullptr) return varlen_tile(shape, cta);
    const int num_m_blocks = common::ceil_div(shape.seqlen_q, kBlockM);
    const int batch_head = cta / num_m_blocks;
    return {batch_head / shape.heads_q, batch_head % shape.heads_q, num_m_blocks - 1 - cta % num_m_blocks,
            0, 0, shape.seqlen_q, shape.seqlen_k, batch_head / shape.heads_q};
  }

  __device__ static Tile varlen_tile(const AttnShape& shape, int cta) {
    const int num_blocks = static_cast<int>(common::varlen_num_blocks(shape.seqlen_q, shape.num_seqs, kBlockM));
    const int virtual_block = num_blocks - 1 - cta % num_blocks;
    const common::VarlenBlock found =
        common::varlen_block<kBlockM>(shape.cu_seqlens_q, shape.num_seqs, shape.seqlen_q, virtual_block);
    const common::VarlenRows q = common::varlen_rows(shape.cu_seqlens_q, shape.seqused_q, found.seq, shape.seqlen_q);
    const common::VarlenRows k = common::varlen_rows(shape.cu_seqlens_k, shape.seqused_k, found.seq, shape.seqlen_k);
    // A block before the sequence's start (a not-from-zero or non-monotone array) has no work either.
    const int m_block = found.block >= 0 ? found.block : common::ceil_div(q.used, kBlockM);
    return {0, cta / num_blocks, m_block, q.start, k.start, q.used, k.used, found.seq};
  }
};

}  // namespace flashjax::sm80

// Maps CTAs to (batch, query head, query block) tiles for the sm80-family forward kernel.
//
// The grid is 1-D (x allows 2^31 - 1 CTAs; y and z would cap batch or heads at 65535). Consecutive CTAs walk the
// query blocks of one (batch, head) before moving on, so the CTAs resident at any moment share that head's K/V in
// L2; within a head they go from the last query block to the first, because with a bottom-right aligned causal
// band the last rows see the most keys: the longest tiles start first and the short ones fill the tail.
#pragma once

#include <cstdint>

#include "flashjax/params.h"
#include "kernels/common/fast_math.cuh"

namespace flashjax::sm80 {

template <int kBlockM>
struct FwdTileScheduler {
  struct Tile {
    int batch;
    int head_q;
    int m_block;
  };

  // 0 when there is no work (Sq = 0, B = 0 or Hq = 0): the launcher must skip the launch.
  static int64_t num_ctas(const AttnShape& shape) {
    return int64_t(common::ceil_div(shape.seqlen_q, kBlockM)) * shape.heads_q * shape.batch;
  }

  __device__ static Tile tile(const AttnShape& shape, int cta) {
    const int num_m_blocks = common::ceil_div(shape.seqlen_q, kBlockM);
    const int batch_head = cta / num_m_blocks;
    return {batch_head / shape.heads_q, batch_head % shape.heads_q, num_m_blocks - 1 - cta % num_m_blocks};
  }
};

}  // namespace flashjax::sm80

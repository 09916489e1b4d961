// Persistent static tile scheduler of the sm90 forward kernel.
//
// The grid has one CTA per SM (read from the device at launch; fewer when there are fewer tiles), and CTA c walks
// tiles c, c + gridDim.x, ... Tiles are numbered m-block fastest, then query head, then batch: the CTAs resident
// at any moment work on few heads and share their K/V in L2. Within a head, when the band makes some m-blocks
// visit more KV blocks than others (causal: the last rows see the most keys; a left-only window: the first), the
// heavier end is numbered first, so the longest tiles start in the first wave and the short ones fill the tail.
// Producer and consumers walk the same sequence independently: no tile index is communicated.
#pragma once

#include <climits>
#include <cstdint>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"

namespace flashjax::sm90 {

template <int kBlockM, int kBlockN>
struct FwdTileSchedulerSm90 {
  struct Params {
    int num_m_blocks;
    int heads_q;
    int num_tiles;
    bool last_m_block_first;  // the last m-block is the heaviest: number m-blocks in reverse
  };

  struct Tile {
    int m_block;
    int head_q;
    int batch;
  };

  // num_tiles = 0 when there is no work (Sq = 0, B = 0 or Hq = 0); -1 when the tile count overflows int32.
  static Params to_params(const AttnShape& shape) {
    const int num_m_blocks = common::ceil_div(shape.seqlen_q, kBlockM);
    const int64_t num_tiles = int64_t(num_m_blocks) * shape.heads_q * shape.batch;
    bool last_first = false;
    if (num_m_blocks > 0) {
      const common::BandMask band(shape.seqlen_q, shape.seqlen_k, shape.window_left, shape.window_right);
      auto blocks_of = [&](int m_block) {
        return band.template kv_blocks<kBlockM, kBlockN>(m_block * kBlockM).num_blocks();
      };
      last_first = blocks_of(num_m_blocks - 1) > blocks_of(0);
    }
    return {num_m_blocks, shape.heads_q, num_tiles > INT_MAX ? -1 : static_cast<int>(num_tiles), last_first};
  }

  static int grid_size(const Params& params, int num_sms) {
    return params.num_tiles < num_sms ? params.num_tiles : num_sms;
  }

  __device__ static int first_tile() { return blockIdx.x; }
  __device__ static int next_tile(int tile) { return tile + gridDim.x; }

  __device__ static Tile tile(const Params& params, int tile) {
    const int m_index = tile % params.num_m_blocks;
    const int head_batch = tile / params.num_m_blocks;
    return {params.last_m_block_first ? params.num_m_blocks - 1 - m_index : m_index, head_batch % params.heads_q,
            head_batch / params.heads_q};
  }
};

}  // namespace flashjax::sm90

// Persistent static tile scheduler of the sm90 forward kernel.
//
// The grid has at most one CTA per SM (read from the device at launch), and every CTA walks a fixed sequence of
// tile indices; producer and consumers walk the same sequence independently, so no tile index is communicated.
// Tiles are numbered m-block fastest, then query head, then batch: the CTAs resident at any moment work on few
// heads and share their K/V in L2.
//
// Balance. With a band (causal: the last rows see the most keys; a left-only window: the first), m-blocks differ
// in work. Handing tiles out round robin (CTA c takes c, c + grid, ...) then gives some CTAs systematically
// heavier tiles: the grid size and the m-block count share a period (132 CTAs against 8 m-blocks at S = 1k, or
// against 128 at S = 16k), and the kernel lasts as long as its busiest CTA (measured: 0.69x of the balanced rate
// at S = 16k causal). So where work varies and there are at least two tiles per CTA, tiles go out in pairs: within
// a head the order is heaviest, lightest, 2nd heaviest, 2nd lightest, ..., and a CTA takes two consecutive tiles
// (2u, 2u + 1) at a time, whose work sums to about the same for every pair (exactly, for causal). Without pairs,
// the heaviest m-block is numbered first, so the longest tiles start in the first wave.
#pragma once

#include <cutlass/fast_math.h>

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
    bool last_m_block_first;  // the last m-block is the heaviest: rank m-blocks from the end
    bool paired;              // hand tiles out in (heavy, light) pairs
    // Division by num_m_blocks and heads_q as a multiply and shift: every consumer warp decodes every tile index
    // between two of its GEMM turns, where a full integer division (~25 instructions each, two per tile) adds to the
    // gap the other warpgroups' GEMMs must cover (ncu at D 64 S 512: ~500 integer instructions per warp per tile).
    cutlass::FastDivmod m_blocks_divmod;
    cutlass::FastDivmod heads_divmod;
  };

  struct Tile {
    int m_block;
    int head_q;
    int batch;
  };

  // num_tiles = 0 when there is no work (Sq = 0, B = 0 or Hq = 0); -1 when the tile count overflows int32.
  static Params to_params(const AttnShape& shape, int num_sms) {
    const int num_m_blocks = common::ceil_div(shape.seqlen_q, kBlockM);
    const int64_t num_tiles = int64_t(num_m_blocks) * shape.heads_q * shape.batch;
    bool last_first = false;
    bool uneven = false;
    if (num_m_blocks > 0) {
      const common::BandMask band(shape.seqlen_q, shape.seqlen_k, shape.window_left, shape.window_right);
      auto blocks_of = [&](int m_block) {
        return band.template kv_blocks<kBlockM, kBlockN>(m_block * kBlockM).num_blocks();
      };
      const int first_blocks = blocks_of(0);
      const int last_blocks = blocks_of(num_m_blocks - 1);
      last_first = last_blocks > first_blocks;
      uneven = last_blocks != first_blocks;
    }
    return {num_m_blocks,
            shape.heads_q,
            num_tiles > INT_MAX ? -1 : static_cast<int>(num_tiles),
            last_first,
            uneven && num_tiles >= 2 * int64_t(num_sms),
            cutlass::FastDivmod(num_m_blocks > 0 ? num_m_blocks : 1),
            cutlass::FastDivmod(shape.heads_q > 0 ? shape.heads_q : 1)};
  }

  static int grid_size(const Params& params, int num_sms) {
    const int units = params.paired ? (params.num_tiles + 1) / 2 : params.num_tiles;
    return units < num_sms ? units : num_sms;
  }

  // The walk of CTA `cta` in a grid of `grid` CTAs (blockIdx.x, gridDim.x in the kernel; host code simulates it
  // in tests/cpp/test_tile_scheduler.cu): first_tile, then next_tile until the index reaches num_tiles.
  __host__ __device__ static int first_tile(const Params& params, int cta) { return params.paired ? 2 * cta : cta; }
  __host__ __device__ static int next_tile(const Params& params, int tile, int grid) {
    if (!params.paired) return tile + grid;
    return (tile & 1) == 0 ? tile + 1 : tile - 1 + 2 * grid;
  }

  // tile in [0, num_tiles).
  __host__ __device__ static Tile tile(const Params& params, int tile) {
    const int num_m = params.num_m_blocks;
    int index, head_batch, head, batch;
    params.m_blocks_divmod(head_batch, index, tile);
    params.heads_divmod(batch, head, head_batch);
    // rank r: the r-th heaviest m-block. Paired: even positions take ranks 0, 1, ... from the heavy end, odd
    // positions ranks M - 1, M - 2, ... from the light end (disjoint and complete for odd M too).
    const int half = index >> 1;
    const int rank = !params.paired ? index : (index & 1) == 0 ? half : num_m - 1 - half;
    return {params.last_m_block_first ? num_m - 1 - rank : rank, head, batch};
  }
};

}  // namespace flashjax::sm90

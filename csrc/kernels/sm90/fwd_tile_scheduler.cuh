// Persistent static tile scheduler of the sm90 forward kernel.
//
// The grid has at most one CTA per SM (read from the device at launch), and every CTA walks a fixed sequence of
// positions; producer and consumers walk the same sequence independently, so no tile index is communicated.
// Positions [0, bulk_tiles) are tiles numbered m-block fastest, then head, then batch: the CTAs resident at any
// moment work on few heads and share their K/V in L2. The walk's heads are the query heads, or the KV heads where
// the call packs GQA (fwd_query_tiling.cuh: a tile then holds rows of every query head of its KV head).
//
// Balance. With a band (causal: the last rows see the most keys; a left-only window: the first), m-blocks differ
// in work. Handing tiles out round robin (CTA c takes c, c + grid, ...) then gives some CTAs systematically
// heavier tiles: the grid size and the m-block count share a period (132 CTAs against 8 m-blocks at S = 1k, or
// against 128 at S = 16k), and the kernel lasts as long as its busiest CTA (measured: 0.69x of the balanced rate
// at S = 16k causal). So where work varies, tiles go out in pairs: within a head the order is heaviest, lightest,
// 2nd heaviest, 2nd lightest, ..., and a CTA takes two consecutive tiles (2u, 2u + 1) at a time, whose work sums to
// about the same for every pair (exactly, for causal). Without pairs, the heaviest m-block is numbered first, so
// the longest tiles start in the first wave.
//
// Equal pairs still leave the last round's rounding: 1024 causal pairs on 132 CTAs are 8 for the busiest CTA
// against a mean of 7.76 (-3% on every causal row from S = 4k at 16k tokens; the time measured on the H200 follows
// the busiest CTA's pair count). So the last heads' tiles (two to three per CTA; their K/V fit in L2) are not paired
// but planned on the host: longest processing time first (the heaviest tile goes to the CTA that the bulk and the
// tiles planned so far leave least loaded), with a tile's cost modelled as its KV blocks plus a fixed per-tile
// cost. The plan travels in the kernel's parameters (CTA c's tail: tail_tiles[tail_begin[c] .. tail_begin[c+1])),
// at positions [bulk_tiles, num_tiles) of the walk. Planning walks the bulk on the host (up to kMaxPlannedTiles
// tiles, tens of microseconds), so launchers cache the plan per shape.
#pragma once

#include <cutlass/fast_math.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/sm90/fwd_query_tiling.cuh"

namespace flashjax::sm90 {

template <int kBlockM, int kBlockN>
struct FwdTileSchedulerSm90 {
  // Bounds of the planned tail; the tables live in the kernel's parameter space (kept under 4 KB in all: with 896
  // tail tiles and packed GQA's two TMA descriptors the kernel's parameters are exactly 4 KB).
  static constexpr int kMaxPlannedCtas = 160;
  static constexpr int kMaxTailTiles = 896;
  static constexpr int kTailTilesPerCta = 2;
  // The host walks the bulk to know each CTA's load: beyond this many tiles the plan is skipped (the rounding it
  // removes is at most 1 / rounds of the work there).
  static constexpr int kMaxPlannedTiles = 16384;
  // Cost model, in fifths of a KV block: a block, and a tile's own path (tail, epilogue, first block: fitted as
  // 1.6 blocks at D = 128 from measured tile times). A tile with no visible key is only written out.
  static constexpr int kCostPerBlock = 5;
  static constexpr int kCostPerTile = 8;
  static constexpr int kCostOfEmptyTile = 1;

  struct Params {
    int num_m_blocks;
    int heads;  // of the walk: Hq, or Hk where GQA is packed
    int num_tiles;
    int grid;               // CTAs to launch
    int bulk_tiles;         // positions below are tiles walked by the static rule, the rest the planned tail
    int bulk_head_batches;  // head-batches in the bulk (tail tile indices count from there)
    bool last_m_block_first;  // the last m-block is the heaviest: rank m-blocks from the end
    bool paired;              // hand bulk tiles out in (heavy, light) pairs
    // Division by num_m_blocks and heads as a multiply and shift: every consumer warp decodes every tile index
    // between two of its GEMM turns, where a full integer division (~25 instructions each, two per tile) adds to the
    // gap the other warpgroups' GEMMs must cover (ncu at D 64 S 512: ~500 integer instructions per warp per tile).
    cutlass::FastDivmod m_blocks_divmod;
    cutlass::FastDivmod heads_divmod;
    uint16_t tail_begin[kMaxPlannedCtas + 1];
    uint16_t tail_tiles[kMaxTailTiles];  // (head-batch - bulk_head_batches) * num_m_blocks + m-block
  };

  struct Tile {
    int m_block;
    int head;  // the query head, or the KV head where GQA is packed
    int batch;
  };

  // num_tiles = 0 when there is no work (Sq = 0, B = 0 or Hq = 0); -1 when the tile count overflows int32.
  // tiling: FwdQueryTiling<kBlockM, packed or not>, the rows of a tile.
  // mask_mod: the tiles walk a mask mod's block lists, whose lengths are device data. Where the band leaves work
  // even, the mod's may still grow along m (a prefix-LM or a causal mod without causal=True: the common shapes),
  // so the last m-block goes first, and the tiles go out in pairs of both ends, which balances work linear in m
  // in either direction, wherever pairs take no more rounds than single tiles (else an even mod would pay for
  // the coarser unit). No tail plan: its costs would be the band's, not the mod's.
  template <typename QueryTiling>
  static Params to_params(const AttnShape& shape, const QueryTiling& tiling, int num_sms, bool mask_mod = false) {
    Params params{};
    const int num_m_blocks = tiling.num_m_blocks();
    const int heads = shape.heads_q / tiling.group;
    const int64_t num_tiles = int64_t(num_m_blocks) * heads * shape.batch;
    const common::BandMask band(shape.seqlen_q, shape.seqlen_k, shape.window_left, shape.window_right);
    auto blocks_of = [&](int m_block) {
      const auto rows = tiling.positions(m_block);
      return band.template kv_blocks_of_rows<kBlockN>(rows.first, rows.last).num_blocks();
    };
    bool uneven = false;
    if (num_m_blocks > 0) {
      const int first_blocks = blocks_of(0);
      const int last_blocks = blocks_of(num_m_blocks - 1);
      params.last_m_block_first = last_blocks > first_blocks || (mask_mod && last_blocks == first_blocks);
      uneven = last_blocks != first_blocks;
    }
    bool pairs = uneven;  // hand the bulk out in (heavy, light) pairs where there are enough tiles
    if (mask_mod && !uneven) {
      const int64_t grid = std::min<int64_t>(num_tiles, num_sms);
      const int64_t pair_grid = std::min<int64_t>((num_tiles + 1) / 2, num_sms);
      const auto rounds = [](int64_t units, int64_t ctas) { return (units + ctas - 1) / ctas; };
      pairs = grid > 0 && pair_grid > 0 && 2 * rounds((num_tiles + 1) / 2, pair_grid) <= rounds(num_tiles, grid);
    }
    params.num_m_blocks = num_m_blocks;
    params.heads = heads;
    params.num_tiles = num_tiles > INT_MAX ? -1 : static_cast<int>(num_tiles);
    params.m_blocks_divmod = cutlass::FastDivmod(num_m_blocks > 0 ? num_m_blocks : 1);
    params.heads_divmod = cutlass::FastDivmod(heads > 0 ? heads : 1);
    params.bulk_tiles = params.num_tiles;
    params.paired = pairs && num_tiles >= 2 * int64_t(num_sms);
    const int units = params.paired ? (params.num_tiles + 1) / 2 : params.num_tiles;
    params.grid = std::min(units, num_sms);
    if (uneven && num_tiles > num_sms && num_tiles <= kMaxPlannedTiles && num_sms <= kMaxPlannedCtas &&
        num_m_blocks <= kMaxTailTiles) {
      plan_tail(params, num_sms, blocks_of);
    }
    return params;
  }

  static int grid_size(const Params& params) { return params.num_tiles > 0 ? params.grid : 0; }

  // The walk of CTA `cta` in a grid of `grid` CTAs (blockIdx.x, gridDim.x in the kernel; host code simulates it
  // in tests/cpp/test_tile_scheduler.cu): first_tile, then next_tile until the position reaches num_tiles.
  __host__ __device__ static int first_tile(const Params& params, int cta) {
    const int first = params.paired ? 2 * cta : cta;
    return first < params.bulk_tiles ? first : tail_start(params, cta);
  }
  __host__ __device__ static int next_tile(const Params& params, int position, int cta, int grid) {
    if (position < params.bulk_tiles) {
      const int next = !params.paired ? position + grid : (position & 1) == 0 ? position + 1 : position - 1 + 2 * grid;
      return next < params.bulk_tiles ? next : tail_start(params, cta);
    }
    const int slot = position - params.bulk_tiles + 1;
    return slot < params.tail_begin[cta + 1] ? params.bulk_tiles + slot : params.num_tiles;
  }

  // position in [0, num_tiles).
  __host__ __device__ static Tile tile(const Params& params, int position) {
    int index, head_batch;
    if (position >= params.bulk_tiles) {
      params.m_blocks_divmod(head_batch, index, int(params.tail_tiles[position - params.bulk_tiles]));
      int head, batch;
      params.heads_divmod(batch, head, head_batch + params.bulk_head_batches);
      return {index, head, batch};
    }
    const int num_m = params.num_m_blocks;
    int head, batch;
    params.m_blocks_divmod(head_batch, index, position);
    params.heads_divmod(batch, head, head_batch);
    // rank r: the r-th heaviest m-block. Paired: even positions take ranks 0, 1, ... from the heavy end, odd
    // positions ranks M - 1, M - 2, ... from the light end (disjoint and complete for odd M too).
    const int half = index >> 1;
    const int rank = !params.paired ? index : (index & 1) == 0 ? half : num_m - 1 - half;
    return {params.last_m_block_first ? num_m - 1 - rank : rank, head, batch};
  }

 private:
  __host__ __device__ static int tail_start(const Params& params, int cta) {
    if (params.bulk_tiles >= params.num_tiles) return params.num_tiles;  // no plan (and grid may exceed the table)
    const int begin = params.tail_begin[cta];
    return begin < params.tail_begin[cta + 1] ? params.bulk_tiles + begin : params.num_tiles;
  }

  // Moves the last head-batches (two to three tiles per CTA) out of the bulk and plans them. How well longest-first
  // packs depends on the exact tile sizes (at S = 16k causal on 132 CTAs: 1.1% over the mean with 3 tail heads,
  // 0.1% with 2 or 4), so a few tail sizes are tried and the one whose busiest CTA is least loaded wins.
  template <typename BlocksOf>
  static void plan_tail(Params& params, int num_sms, const BlocksOf& blocks_of) {
    const int num_m = params.num_m_blocks;
    const int head_batches = params.num_tiles / num_m;
    const int grid = std::min(params.num_tiles, num_sms);
    const int most_tail = std::min(head_batches, kMaxTailTiles / num_m);
    const int fewest_tail = std::min(most_tail, common::ceil_div(kTailTilesPerCta * grid, num_m));
    const int last_tail = std::min(most_tail, fewest_tail + 4);
    params.grid = grid;
    params.paired = true;  // the bulk in pairs (a bulk of under two rounds leaves the difference to the plan)

    std::vector<int64_t> cost_of_m(num_m);
    for (int m = 0; m < num_m; ++m) {
      const int blocks = blocks_of(m);
      cost_of_m[m] = blocks > 0 ? kCostPerBlock * blocks + kCostPerTile : kCostOfEmptyTile;
    }
    std::vector<int> m_by_cost(num_m);  // heaviest first (ties: lower m-block first)
    for (int m = 0; m < num_m; ++m) m_by_cost[m] = m;
    std::stable_sort(m_by_cost.begin(), m_by_cost.end(),
                     [&](int a, int b) { return cost_of_m[a] > cost_of_m[b]; });

    // Each CTA's bulk load for every candidate tail: the bulks are prefixes of one another, so one pass over the
    // largest bulk, saving the loads at each smaller bulk's end. CTA of position p: pair p / 2, round robin.
    std::vector<std::vector<int64_t>> bulk_loads(last_tail - fewest_tail + 1);
    {
      std::vector<int64_t> loads(grid, 0);
      params.bulk_tiles = (head_batches - fewest_tail) * num_m;  // so that tile() decodes every position as bulk
      int pos = 0;
      for (int tail = last_tail; tail >= fewest_tail; --tail) {
        for (const int end = (head_batches - tail) * num_m; pos < end; ++pos) {
          loads[(pos >> 1) % grid] += cost_of_m[tile(params, pos).m_block];
        }
        bulk_loads[tail - fewest_tail] = loads;
      }
    }
    // Longest first onto the least loaded CTA; owner (if given) receives each tail tile's CTA in that order.
    using Load = std::pair<int64_t, int>;  // (cost so far, CTA)
    auto pack = [&](int tail, std::vector<int>* owner) {
      std::priority_queue<Load, std::vector<Load>, std::greater<Load>> least_loaded;
      const std::vector<int64_t>& loads = bulk_loads[tail - fewest_tail];
      for (int cta = 0; cta < grid; ++cta) least_loaded.push({loads[cta], cta});
      for (int m : m_by_cost) {
        for (int head_batch = 0; head_batch < tail; ++head_batch) {
          auto [load, cta] = least_loaded.top();
          least_loaded.pop();
          least_loaded.push({load + cost_of_m[m], cta});
          if (owner != nullptr) owner->push_back(cta);
        }
      }
      int64_t busiest = 0;
      for (; !least_loaded.empty(); least_loaded.pop()) busiest = std::max(busiest, least_loaded.top().first);
      return busiest;
    };
    int best_tail = fewest_tail;
    int64_t best_busiest = pack(fewest_tail, nullptr);
    for (int tail = fewest_tail + 1; tail <= last_tail; ++tail) {
      const int64_t busiest = pack(tail, nullptr);
      if (busiest < best_busiest) best_busiest = busiest, best_tail = tail;
    }

    params.bulk_head_batches = head_batches - best_tail;
    params.bulk_tiles = params.bulk_head_batches * num_m;
    std::vector<int> owner;
    owner.reserve(best_tail * num_m);
    pack(best_tail, &owner);
    // Tables: each CTA's tail tiles in the order they were packed (heaviest first).
    std::vector<int> begin(grid + 1, 0);
    for (int cta : owner) ++begin[cta + 1];
    for (int cta = 0; cta < grid; ++cta) begin[cta + 1] += begin[cta];
    for (int cta = 0; cta <= grid; ++cta) params.tail_begin[cta] = static_cast<uint16_t>(begin[cta]);
    int packed = 0;
    for (int m : m_by_cost) {
      for (int head_batch = 0; head_batch < best_tail; ++head_batch) {
        params.tail_tiles[begin[owner[packed++]]++] = static_cast<uint16_t>(head_batch * num_m + m);
      }
    }
  }
};

}  // namespace flashjax::sm90

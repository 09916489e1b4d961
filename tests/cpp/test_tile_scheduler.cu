// The sm90 forward's persistent tile scheduler (csrc/kernels/sm90/fwd_tile_scheduler.cuh), simulated on the host:
// every CTA's walk together visits every tile exactly once, tiles map one-to-one onto (m-block, head, batch), and
// where m-blocks differ in work (causal, windows) the busiest CTA does not carry much more than the average.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kernels/sm90/fwd_tile_scheduler.cuh"

namespace flashjax::sm90 {
namespace {

// The tile most calls take; EveryTileOnceForEveryShape also walks D = 64's 192-row tile.
constexpr int kBlockM = 128;
constexpr int kBlockN = 128;

AttnShape make_shape(int batch, int heads, int sq, int sk, int left, int right) {
  AttnShape shape{};
  shape.batch = batch;
  shape.heads_q = heads;
  shape.heads_k = heads;
  shape.seqlen_q = sq;
  shape.seqlen_k = sk;
  shape.window_left = left;
  shape.window_right = right;
  return shape;
}

struct Walk {
  double max_work = 0;   // KV blocks visited by the busiest CTA
  double mean_work = 0;  // ... and on average
  bool paired = false;
};

// Walks every CTA of the launch grid and checks coverage; returns the work per CTA.
template <int kTileM = kBlockM, int kTileN = kBlockN>
Walk walk_all(const AttnShape& shape, int num_sms) {
  using Scheduler = FwdTileSchedulerSm90<kTileM, kTileN>;
  SCOPED_TRACE(::testing::Message() << "B " << shape.batch << " H " << shape.heads_q << " Sq " << shape.seqlen_q
                                    << " Sk " << shape.seqlen_k << " window (" << shape.window_left << ", "
                                    << shape.window_right << ") SMs " << num_sms << " tile " << kTileM << "x"
                                    << kTileN);
  const typename Scheduler::Params params = Scheduler::to_params(shape, num_sms);
  const int grid = Scheduler::grid_size(params, num_sms);
  const common::BandMask band(shape.seqlen_q, shape.seqlen_k, shape.window_left, shape.window_right);
  EXPECT_GE(grid, params.num_tiles > 0 ? 1 : 0);
  EXPECT_LE(grid, num_sms);
  std::vector<int> tile_seen(params.num_tiles, 0);
  std::vector<int> coord_seen(params.num_tiles, 0);
  Walk result;
  result.paired = params.paired;
  double total = 0;
  for (int cta = 0; cta < grid; ++cta) {
    double work = 0;
    for (int t = Scheduler::first_tile(params, cta); t < params.num_tiles; t = Scheduler::next_tile(params, t, grid)) {
      ++tile_seen[t];
      const typename Scheduler::Tile tile = Scheduler::tile(params, t);
      EXPECT_GE(tile.m_block, 0);
      EXPECT_LT(tile.m_block, params.num_m_blocks);
      EXPECT_GE(tile.head_q, 0);
      EXPECT_LT(tile.head_q, shape.heads_q);
      EXPECT_GE(tile.batch, 0);
      EXPECT_LT(tile.batch, shape.batch);
      ++coord_seen[(tile.batch * shape.heads_q + tile.head_q) * params.num_m_blocks + tile.m_block];
      work += band.template kv_blocks<kTileM, kTileN>(tile.m_block * kTileM).num_blocks();
    }
    result.max_work = std::max(result.max_work, work);
    total += work;
  }
  for (int t = 0; t < params.num_tiles; ++t) {
    EXPECT_EQ(tile_seen[t], 1) << "tile index " << t;
    EXPECT_EQ(coord_seen[t], 1) << "(batch, head, m-block) #" << t;
  }
  result.mean_work = grid > 0 ? total / grid : 0;
  return result;
}

TEST(Sm90TileScheduler, EveryTileOnceForEveryShape) {
  for (int sms : {132, 114, 7, 1}) {
    for (int sq : {1, 77, 128, 129, 1000, 4096}) {
      for (int sk : {1, 300, 4096}) {
        for (auto [left, right] : {std::pair{-1, -1}, {-1, 0}, {256, 0}, {0, 0}, {100, 300}}) {
          for (auto [batch, heads] : {std::pair{1, 1}, {2, 3}, {4, 16}}) {
            walk_all(make_shape(batch, heads, sq, sk, left, right), sms);
            walk_all<192, 128>(make_shape(batch, heads, sq, sk, left, right), sms);
          }
        }
      }
    }
  }
}

// The case that motivated pairing: 132 CTAs against 128 m-blocks per head, causal. Round robin over tiles put
// 1.5x the mean work on the busiest CTA; pairs put the same on every CTA up to the last unit's rounding.
TEST(Sm90TileScheduler, CausalWorkIsBalanced) {
  struct Case {
    int batch, heads, seqlen;
  };
  for (const Case c : {Case{1, 16, 16384}, Case{2, 16, 8192}, Case{4, 16, 4096}, Case{16, 32, 1024},
                       Case{32, 32, 512}}) {
    for (int sms : {132, 114}) {
      const Walk w = walk_all(make_shape(c.batch, c.heads, c.seqlen, c.seqlen, -1, 0), sms);
      EXPECT_TRUE(w.paired);
      // Every CTA runs floor or ceil of (pairs / grid) equal-work pairs.
      const int pairs = c.batch * c.heads * ((c.seqlen + kBlockM - 1) / kBlockM) / 2;
      const double per_pair = w.mean_work * std::min(sms, pairs) / pairs;
      EXPECT_LE(w.max_work, per_pair * ((pairs + sms - 1) / sms) + 1e-9)
          << "seqlen " << c.seqlen << " SMs " << sms << ": busiest CTA " << w.max_work << ", mean " << w.mean_work;
    }
  }
}

TEST(Sm90TileScheduler, UniformWorkIsNotPaired) {
  EXPECT_FALSE(walk_all(make_shape(4, 16, 4096, 4096, -1, -1), 132).paired);
  // Too few tiles for two per CTA: one tile per CTA keeps every SM busy.
  EXPECT_FALSE(walk_all(make_shape(1, 2, 4096, 4096, -1, 0), 132).paired);
}

}  // namespace
}  // namespace flashjax::sm90

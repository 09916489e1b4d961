// The sm90 forward's persistent tile scheduler (csrc/kernels/sm90/fwd_tile_scheduler.cuh), simulated on the host:
// every CTA's walk together visits every tile exactly once, tiles map one-to-one onto (m-block, head, batch), their
// rows (fwd_query_tiling.cuh, packed GQA or not) onto the (position, query head) pairs of each batch, and where
// m-blocks differ in work (causal, windows) the busiest CTA does not carry much more than the average, in the cost
// model the tail plan uses.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <utility>
#include <vector>

#include "kernels/sm90/fwd_tile_scheduler.cuh"

namespace flashjax::sm90 {
namespace {

// Spelled out: CUDA 12.4's front end cannot deduce a braced list of pairs in a range-for (13.0's and g++'s can).
using IntPairs = std::initializer_list<std::pair<int, int>>;

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
  double max_work = 0;   // modelled cost (KV blocks and per-tile cost) of the busiest CTA
  double mean_work = 0;  // ... and on average
  bool paired = false;
  bool planned = false;  // some tiles were planned (tail) rather than walked by the static rule
};

// Walks every CTA of the launch grid and checks coverage; returns the work per CTA. group > 1: GQA packed, the
// query heads of a KV head `group` to a tile. mask_mod: the walk of the mask-mod kernel, whose tiles' KV blocks
// mod_blocks(m-block) gives (a mod's block lists; the band's blocks where it is empty).
template <int kTileM = kBlockM, int kTileN = kBlockN>
Walk walk_all(const AttnShape& shape, int num_sms, int group = 1, bool mask_mod = false,
              const std::function<int(int)>& mod_blocks = {}) {
  using Scheduler = FwdTileSchedulerSm90<kTileM, kTileN>;
  SCOPED_TRACE(::testing::Message() << "B " << shape.batch << " H " << shape.heads_q << " Sq " << shape.seqlen_q
                                    << " Sk " << shape.seqlen_k << " window (" << shape.window_left << ", "
                                    << shape.window_right << ") SMs " << num_sms << " tile " << kTileM << "x"
                                    << kTileN << " group " << group);
  // The walk over tiles of either kind (group 1: the unpacked tiling the kernels use for it).
  auto walk = [&](const auto& tiling) {
    const typename Scheduler::Params params = Scheduler::to_params(shape, tiling, num_sms, mask_mod);
    const int heads = shape.heads_q / group;
    const int grid = Scheduler::grid_size(params);
    const common::BandMask band(shape.seqlen_q, shape.seqlen_k, shape.window_left, shape.window_right);
    EXPECT_GE(grid, params.num_tiles > 0 ? 1 : 0);
    EXPECT_LE(grid, num_sms);
    std::vector<int> tile_seen(params.num_tiles, 0);
    std::vector<int> coord_seen(params.num_tiles, 0);
    std::vector<int> row_seen(size_t(shape.batch) * shape.heads_q * shape.seqlen_q, 0);
    Walk result;
    result.paired = params.paired;
    result.planned = params.bulk_tiles < params.num_tiles;
    double total = 0;
    for (int cta = 0; cta < grid; ++cta) {
      double work = 0;
      for (int t = Scheduler::first_tile(params, cta); t < params.num_tiles;
           t = Scheduler::next_tile(params, t, cta, grid)) {
        ++tile_seen[t];
        const typename Scheduler::Tile tile = Scheduler::tile(params, t);
        EXPECT_GE(tile.m_block, 0);
        EXPECT_LT(tile.m_block, params.num_m_blocks);
        EXPECT_GE(tile.head, 0);
        EXPECT_LT(tile.head, heads);
        EXPECT_GE(tile.batch, 0);
        EXPECT_LT(tile.batch, shape.batch);
        ++coord_seen[(tile.batch * heads + tile.head) * params.num_m_blocks + tile.m_block];
        const auto positions = tiling.positions(tile.m_block);
        EXPECT_LE(positions.first, positions.last);
        EXPECT_LT(positions.last, shape.seqlen_q);
        for (int r = 0; r < kTileM; ++r) {
          const auto row = tiling.row(tile.m_block, tile.head, r);
          if (row.position >= shape.seqlen_q) continue;
          EXPECT_GE(row.position, positions.first);
          EXPECT_LE(row.position, positions.last);
          EXPECT_EQ(row.head_q / group, tile.head);
          ++row_seen[(size_t(tile.batch) * shape.heads_q + row.head_q) * shape.seqlen_q + row.position];
        }
        const int blocks = mod_blocks ? mod_blocks(tile.m_block)
                                      : band.template kv_blocks_of_rows<kTileN>(positions.first, positions.last).num_blocks();
        work += blocks > 0 ? Scheduler::kCostPerBlock * blocks + Scheduler::kCostPerTile : Scheduler::kCostOfEmptyTile;
      }
      result.max_work = std::max(result.max_work, work);
      total += work;
    }
    for (int t = 0; t < params.num_tiles; ++t) {
      EXPECT_EQ(tile_seen[t], 1) << "tile index " << t;
      EXPECT_EQ(coord_seen[t], 1) << "(batch, head, m-block) #" << t;
    }
    for (size_t i = 0; i < row_seen.size(); ++i) EXPECT_EQ(row_seen[i], 1) << "(batch, query head, position) #" << i;
    result.mean_work = grid > 0 ? total / grid : 0;
    return result;
  };
  return group > 1 ? walk(FwdQueryTiling<kTileM, true>(group, shape.seqlen_q))
                   : walk(FwdQueryTiling<kTileM, false>(1, shape.seqlen_q));
}

TEST(Sm90TileScheduler, EveryTileOnceForEveryShape) {
  for (int sms : {132, 114, 7, 1}) {
    for (int sq : {1, 77, 128, 129, 1000, 4096}) {
      for (int sk : {1, 300, 4096}) {
        for (auto [left, right] : IntPairs{{-1, -1}, {-1, 0}, {256, 0}, {0, 0}, {100, 300}}) {
          for (auto [batch, heads] : IntPairs{{1, 1}, {2, 3}, {4, 16}}) {
            walk_all(make_shape(batch, heads, sq, sk, left, right), sms);
            walk_all<192, 128>(make_shape(batch, heads, sq, sk, left, right), sms);
            walk_all(make_shape(batch, heads, sq, sk, left, right), sms, 1, /*mask_mod=*/true);
          }
        }
      }
    }
  }
}

// Longest-first packing ends with the cheapest tiles: the busiest CTA should sit within about two one-block tiles
// of the mean (or 0.5% of it).
template <int kTileM = kBlockM, int kTileN = kBlockN>
double balanced_bound(const Walk& w) {
  using Scheduler = FwdTileSchedulerSm90<kTileM, kTileN>;
  return std::max(1.005 * w.mean_work, w.mean_work + 2 * (Scheduler::kCostPerBlock + Scheduler::kCostPerTile));
}

// The case that motivated pairing: 132 CTAs against 128 m-blocks per head, causal. Round robin over tiles put
// 1.5x the mean work on the busiest CTA. Pairs alone left the last round's rounding (1024 pairs on 132 CTAs: 8
// against a mean of 7.76, 3% over); the planned tail removes it.
TEST(Sm90TileScheduler, CausalWorkIsBalanced) {
  struct Case {
    int batch, heads, seqlen;
  };
  for (const Case c : {Case{1, 16, 16384}, Case{2, 16, 8192}, Case{4, 16, 4096}, Case{8, 16, 2048},
                       Case{16, 32, 1024}, Case{32, 32, 512}, Case{1, 8, 65536}}) {
    for (int sms : {132, 114, 78}) {
      const Walk w = walk_all(make_shape(c.batch, c.heads, c.seqlen, c.seqlen, -1, 0), sms);
      EXPECT_TRUE(w.planned);
      EXPECT_LE(w.max_work, balanced_bound(w))
          << "B " << c.batch << " H " << c.heads << " S " << c.seqlen << " SMs " << sms << ": busiest CTA "
          << w.max_work << ", mean " << w.mean_work;
    }
  }
  // One long sequence: every tile is planned, and longest-first leaves up to 4% over the mean with ~4 tiles of
  // very different sizes per CTA (pairs alone: 256 pairs on 114 CTAs, 33% over).
  for (int sms : {132, 114, 78}) {
    const Walk w = walk_all(make_shape(1, 1, 65536, 65536, -1, 0), sms);
    EXPECT_LE(w.max_work, 1.04 * w.mean_work) << "SMs " << sms;
  }
}

// A mask mod's work is device data; where the band is even the walk assumes it may grow along m (a prefix-LM mod,
// a causal mod without causal=True): the last m-block first, and pairs of both ends where they take no more rounds
// than single tiles. Prefix LM at B 4 S 4k (prefix 1024, 128-row tiles: m-block m sees max(8, m + 1) KV blocks),
// in this model: the busiest CTA at 1.09x the mean by round robin on 132 SMs, 1.05x paired. Never worse than
// round robin, for that mod or an even one.
TEST(Sm90TileScheduler, MaskModWalkPairsTheEnds) {
  const auto prefix_lm = [](int m) { return std::max(8, m + 1); };
  const auto even = [](int) { return 32; };
  for (const AttnShape& shape : {make_shape(4, 16, 4096, 4096, -1, -1), make_shape(1, 16, 16384, 16384, -1, -1),
                                 make_shape(2, 3, 1000, 1000, -1, -1)}) {
    for (int sms : {132, 114, 78}) {
      const Walk plain = walk_all(shape, sms, 1, /*mask_mod=*/false, prefix_lm);
      const Walk mod = walk_all(shape, sms, 1, /*mask_mod=*/true, prefix_lm);
      EXPECT_FALSE(mod.planned);  // no tail plan: its costs would be the band's
      EXPECT_LE(mod.max_work, plain.max_work) << "B " << shape.batch << " S " << shape.seqlen_q << " SMs " << sms;
      EXPECT_LE(walk_all(shape, sms, 1, true, even).max_work, walk_all(shape, sms, 1, false, even).max_work)
          << "B " << shape.batch << " S " << shape.seqlen_q << " SMs " << sms;
    }
  }
  const AttnShape prefix_4k = make_shape(4, 16, 4096, 4096, -1, -1);
  const Walk paired = walk_all(prefix_4k, 132, 1, true, prefix_lm);
  EXPECT_TRUE(paired.paired);
  EXPECT_LE(paired.max_work, 1.06 * paired.mean_work);
  EXPECT_LT(paired.max_work, walk_all(prefix_4k, 132, 1, false, prefix_lm).max_work);
}

// Left-only windows (the first rows are the heavy ones) and windows with both sides are planned as well.
TEST(Sm90TileScheduler, WindowWorkIsBalanced) {
  for (auto [left, right] : IntPairs{{1024, 0}, {-1, 1024}, {2048, 512}}) {
    const Walk w = walk_all(make_shape(2, 16, 8192, 8192, left, right), 132);
    EXPECT_TRUE(w.planned);
    EXPECT_LE(w.max_work, balanced_bound(w)) << "window (" << left << ", " << right << ")";
  }
}

// Beyond the plan's tables the walk is the static rule alone, still covering every tile once.
TEST(Sm90TileScheduler, UnplannedBeyondTheTables) {
  using Scheduler = FwdTileSchedulerSm90<kBlockM, kBlockN>;
  EXPECT_FALSE(walk_all(make_shape(4, 16, 4096, 4096, -1, 0), Scheduler::kMaxPlannedCtas + 1).planned);
  EXPECT_FALSE(walk_all(make_shape(64, 16, 4096, 4096, -1, 0), 132).planned);  // more tiles than the host walks
  EXPECT_TRUE(walk_all(make_shape(64, 16, 4096, 4096, -1, 0), 132).paired);
  EXPECT_FALSE(walk_all(make_shape(1, 1, 128 * (Scheduler::kMaxTailTiles + 1), 128 * (Scheduler::kMaxTailTiles + 1),
                                   -1, 0),
                        132)
                   .planned);
}

// Packed GQA: every query head's every position once, with tiles of 8-position chunks head fastest; causal and
// windowed groups are balanced like unpacked heads.
TEST(Sm90TileScheduler, PackedGqaCoversEveryRowOnce) {
  for (int sms : {132, 7, 1}) {
    for (int sq : {1, 7, 8, 9, 77, 129, 1000}) {
      for (int sk : {1, 300, 4096}) {
        for (auto [left, right] : IntPairs{{-1, -1}, {-1, 0}, {256, 0}}) {
          for (int group : {2, 3, 4, 8, 16}) {
            walk_all(make_shape(2, 2 * group, sq, sk, left, right), sms, group);
            walk_all<192, 128>(make_shape(1, group, sq, sk, left, right), sms, group);
          }
        }
      }
    }
  }
  const Walk w = walk_all(make_shape(4, 32, 2048, 2048, -1, 0), 132, 4);
  EXPECT_TRUE(w.planned);
  EXPECT_LE(w.max_work, balanced_bound(w));
}

TEST(Sm90TileScheduler, UniformWorkIsNotPaired) {
  EXPECT_FALSE(walk_all(make_shape(4, 16, 4096, 4096, -1, -1), 132).paired);
  EXPECT_FALSE(walk_all(make_shape(4, 16, 4096, 4096, -1, -1), 132).planned);
  // Too few tiles for two per CTA: one tile per CTA keeps every SM busy.
  EXPECT_FALSE(walk_all(make_shape(1, 2, 4096, 4096, -1, 0), 132).paired);
}

}  // namespace
}  // namespace flashjax::sm90

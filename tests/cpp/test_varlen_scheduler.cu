// The sm90 forward's varlen walk (csrc/kernels/sm90/fwd_varlen_scheduler.cuh), simulated on the host: whatever the
// offsets hold, every tile's rows and keys lie inside the packed tensors; the tiles and the fill
// (row_written false) together write every query row, and never the same row twice where the offsets are well
// formed (then a row is the tiles' exactly when it is a used row of some sequence). The CTAs' ranges (the balance,
// fwd_varlen_balance.cuh) cover the walk disjointly whatever the offsets, give the same answer for any lane count,
// and spread random causal packs evenly in the cost model.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <random>
#include <vector>

#include "kernels/sm90/fwd_query_tiling.cuh"
#include "kernels/sm90/fwd_varlen_scheduler.cuh"

namespace flashjax::sm90 {
namespace {

struct Packing {
  std::vector<int32_t> cu_q, cu_k, used_q, used_k;  // used: empty for none
  int total_q, total_k;
  bool well_formed;
};

// heads: Hq; group > 1: packed GQA (kPacked), Hk = Hq / group.
template <int kBlockM, int kBlockN = 128, bool kPacked = false>
void check_walk(const Packing& p, int heads, int num_sms = 7, int window_left = -1, int window_right = -1,
                int group = 1, bool balanced = true) {
  using Scheduler = FwdVarlenTileSchedulerSm90<kBlockM, kBlockN, kPacked>;
  using Tiling = FwdQueryTiling<kBlockM, kPacked>;
  AttnShape shape{};
  shape.batch = 1;
  shape.heads_q = heads;
  shape.heads_k = heads / group;
  shape.seqlen_q = p.total_q;
  shape.seqlen_k = p.total_k;
  shape.num_seqs = static_cast<int>(p.cu_q.size()) - 1;
  shape.cu_seqlens_q = p.cu_q.data();
  shape.cu_seqlens_k = p.cu_k.data();
  shape.seqused_q = p.used_q.empty() ? nullptr : p.used_q.data();
  shape.seqused_k = p.used_k.empty() ? nullptr : p.used_k.data();
  shape.window_left = window_left;
  shape.window_right = window_right;
  const typename Scheduler::Params params =
      [&] {
        auto made = Scheduler::to_params(shape, Tiling(group, p.total_q), num_sms);
        made.balanced = balanced;  // FLASHJAX_SM90_VARLEN_WALK's choice
        return made;
      }();
  ASSERT_GE(params.num_tiles, 0);
  // The virtual blocks per head: Tq / kBlockM + N (packed: G (Tq / 8 + N) / (kBlockM / 8) + N), never N x max_seqlen.
  EXPECT_EQ(params.num_blocks, kPacked ? group * (p.total_q / 8 + shape.num_seqs) / (kBlockM / 8) + shape.num_seqs
                                       : p.total_q / kBlockM + shape.num_seqs);
  EXPECT_EQ(params.heads, heads / group);

  std::vector<int> writes(size_t(p.total_q) * heads, 0);
  std::vector<int> visited(params.num_tiles, 0);
  for (int cta = 0; cta < params.grid; ++cta) {
    const typename Scheduler::Range range = Scheduler::cta_range_host(params, cta, params.grid);
    ASSERT_TRUE(range.begin >= 0 && range.end <= params.num_tiles) << "cta " << cta;
    for (const int lanes : {1, 5, 32, 64}) {  // the warp's lanes split the sequences; the answer must not depend on it
      const typename Scheduler::Range other = Scheduler::cta_range_host(params, cta, params.grid, lanes);
      ASSERT_EQ(other.begin, range.begin) << "cta " << cta << " lanes " << lanes;
      ASSERT_EQ(other.end, range.end) << "cta " << cta << " lanes " << lanes;
    }
    for (int pos = Scheduler::first_tile(params, range); pos < params.num_tiles;
         pos = Scheduler::next_tile(params, range.end, range.stride, pos)) {
      ++visited[pos];
      const typename Scheduler::Tile tile = Scheduler::tile(params, pos);
      ASSERT_TRUE(tile.head >= 0 && tile.head < heads / group);
      ASSERT_TRUE(tile.q_start >= 0 && tile.seqlen_q >= 0 && tile.q_start + tile.seqlen_q <= p.total_q);
      ASSERT_TRUE(tile.k_start >= 0 && tile.seqlen_k >= 0 && tile.k_start + tile.seqlen_k <= p.total_k);
      ASSERT_GE(tile.m_block, 0);
      if (!tile.has_rows()) continue;
      // A tile writes the rows of its sequence's used positions that its tiling gives it (unpacked: positions
      // [m_block * kBlockM, (m_block + 1) * kBlockM) of its head; packed: chunks of the group's heads).
      const Tiling tiling(group, tile.seqlen_q);
      for (int r = 0; r < kBlockM; ++r) {
        const auto row = tiling.row(tile.m_block, tile.head, r);
        ASSERT_TRUE(row.head_q >= 0 && row.head_q < heads);
        if (row.position < tile.seqlen_q) ++writes[size_t(tile.q_start + row.position) * heads + row.head_q];
      }
    }
  }
  for (int pos = 0; pos < params.num_tiles; ++pos) ASSERT_EQ(visited[pos], 1) << "position " << pos;
  for (int t = 0; t < p.total_q; ++t) {
    const bool by_tiles = Scheduler::row_written(params, t);
    for (int h = 0; h < heads; ++h) {
      const int tile_writes = writes[size_t(t) * heads + h];
      // row_written promises a tile writes the row (so the fill may skip it); otherwise the fill writes it.
      if (by_tiles) EXPECT_GE(tile_writes, 1) << "row " << t << " head " << h;
      if (p.well_formed) EXPECT_EQ(tile_writes, by_tiles ? 1 : 0) << "row " << t << " head " << h;
    }
  }
  if (p.well_formed) {  // then the tiles' rows are exactly the used rows of the sequences
    for (size_t b = 0; b + 1 < p.cu_q.size(); ++b) {
      const int used = p.used_q.empty() ? p.cu_q[b + 1] - p.cu_q[b] : p.used_q[b];
      for (int t = p.cu_q[b]; t < p.cu_q[b + 1]; ++t) {
        EXPECT_EQ(Scheduler::row_written(params, t), t < p.cu_q[b] + used) << "sequence " << b << " row " << t;
      }
    }
  }
}

const std::vector<Packing>& packings() {
  constexpr int32_t kMax = INT32_MAX;
  static const std::vector<Packing> all = {
      // Lengths around the 64-row warpgroups and the tiles, an empty sequence, padding past cu_seqlens[N].
      {{0, 63, 127, 192, 192, 320, 449}, {0, 129, 257, 322, 322, 386, 449}, {}, {}, 460, 470, true},
      {{0, 1, 2, 3}, {0, 700, 1000, 2900}, {1, 0, 1}, {1, 0, 700}, 3, 3000, true},  // decode with seqused
      {{0, 700, 700, 1400}, {0, 800, 800, 1700}, {650, 0, 699}, {650, 0, 899}, 1400, 1710, true},
      {{0, 0, 0}, {0, 5, 9}, {}, {}, 40, 9, true},  // no query rows in any sequence: everything is the fill's
      {{0, 40, 20, 90}, {90, 20, 40, 0}, {}, {}, 90, 120, false},  // decreasing
      {{-50, 10, -3, 90}, {17, 40, 5000, 80}, {kMax, -5, 7}, {kMax, -5, 7}, 90, 120, false},
      {{0, kMax, kMax, kMax}, {0, kMax, kMax, kMax}, {}, {}, 90, 120, false},
      {{17, 40, 60, 80}, {0, kMax, -7, 120}, {3, kMax, 0}, {3, kMax, 0}, 90, 120, false},  // not from zero
  };
  return all;
}

TEST(VarlenScheduler, TilesAndFillCoverEveryRowInBounds) {
  for (size_t i = 0; i < packings().size(); ++i) {
    SCOPED_TRACE("packing " + std::to_string(i));
    check_walk<128>(packings()[i], 3);
    check_walk<64>(packings()[i], 1);
  }
}

// Packed GQA (decode-like calls): the group's query heads share each tile.
TEST(VarlenScheduler, PackedGqaCoversEveryRowInBounds) {
  for (size_t i = 0; i < packings().size(); ++i) {
    SCOPED_TRACE("packing " + std::to_string(i));
    check_walk<128, 128, true>(packings()[i], 8, /*num_sms=*/7, -1, -1, /*group=*/4);
    check_walk<128, 128, true>(packings()[i], 32, /*num_sms=*/132, -1, 0, /*group=*/32);
    check_walk<128, 80, true>(packings()[i], 6, /*num_sms=*/3, 50, 0, /*group=*/3);
    check_walk<128, 128, true>(packings()[i], 2, /*num_sms=*/5, -1, -1, /*group=*/1);
  }
  // Decode: one query per sequence, 64 sequences, GQA 32:8: one tile per (sequence, KV head).
  Packing decode{{0}, {0}, {}, {}, 64, 0, true};
  for (int b = 0; b < 64; ++b) {
    decode.cu_q.push_back(b + 1);
    decode.cu_k.push_back(decode.cu_k.back() + 1000 + 37 * b);
  }
  decode.total_k = decode.cu_k.back();
  check_walk<128, 128, true>(decode, 32, /*num_sms=*/132, -1, 0, /*group=*/4);
}

TEST(VarlenScheduler, WindowsAndManyCtas) {
  for (size_t i = 0; i < packings().size(); ++i) {
    SCOPED_TRACE("packing " + std::to_string(i));
    check_walk<128, 128>(packings()[i], 2, /*num_sms=*/132, /*window_left=*/-1, /*window_right=*/0);
    check_walk<128, 80>(packings()[i], 3, /*num_sms=*/5, /*window_left=*/100, /*window_right=*/0);
    check_walk<64, 128>(packings()[i], 1, /*num_sms=*/1);
    // FLASHJAX_SM90_VARLEN_WALK=0: round robin.
    check_walk<128, 128>(packings()[i], 3, /*num_sms=*/7, -1, 0, 1, /*balanced=*/false);
    check_walk<128, 128, true>(packings()[i], 8, /*num_sms=*/5, -1, -1, 4, /*balanced=*/false);
  }
}

// Random causal packs (bench/varlen.py's pack rows) on 132 CTAs: the busiest CTA's modelled work over the mean CTA's,
// with every tile's exact KV blocks (the balance itself interpolates them per sequence). Round robin gave 1.2 to 1.6
// for the 64-sequence pack (lab/experiments/varlen_order_sim.py).
TEST(VarlenScheduler, BalancesRandomCausalPacks) {
  constexpr int kBlock = 128, kHeads = 16, kSms = 132;
  using Scheduler = FwdVarlenTileSchedulerSm90<kBlock, kBlock>;
  struct Row {
    int n, lo, hi;
    double bound;
  };
  for (const Row row : {Row{64, 1, 1024, 1.06}, Row{1000, 0, 512, 1.01}}) {
    for (int seed = 0; seed < 5; ++seed) {
      std::mt19937 rng(seed);
      std::uniform_int_distribution<int> length(row.lo, row.hi);
      std::vector<int32_t> cu = {0};
      for (int b = 0; b < row.n; ++b) cu.push_back(cu.back() + length(rng));
      AttnShape shape{};
      shape.batch = 1;
      shape.heads_q = shape.heads_k = kHeads;
      shape.seqlen_q = shape.seqlen_k = cu.back();
      shape.num_seqs = row.n;
      shape.cu_seqlens_q = shape.cu_seqlens_k = cu.data();
      shape.window_left = -1;
      shape.window_right = 0;
      auto params = Scheduler::to_params(shape, FwdQueryTiling<kBlock, false>(1, cu.back()), kSms);
      params.balanced = true;  // the ranges FLASHJAX_SM90_VARLEN_WALK=1 asks for (round robin is the default)
      std::vector<double> load(params.grid, 0.0);
      for (int cta = 0; cta < params.grid; ++cta) {
        const auto range = Scheduler::cta_range_host(params, cta, params.grid);
        for (int pos = Scheduler::first_tile(params, range); pos < params.num_tiles;
             pos = Scheduler::next_tile(params, range.end, range.stride, pos)) {
          const auto tile = Scheduler::tile(params, pos);
          if (!tile.has_rows()) {
            load[cta] += 1;
            continue;
          }
          const common::BandMask band(tile.seqlen_q, tile.seqlen_k, -1, 0);
          load[cta] += 5.0 * band.kv_blocks<kBlock, kBlock>(tile.m_block * kBlock).num_blocks() + 8;
        }
      }
      double sum = 0;
      for (double l : load) sum += l;
      const double ratio = *std::max_element(load.begin(), load.end()) / (sum / load.size());
      EXPECT_LE(ratio, row.bound) << row.n << " sequences, seed " << seed;
    }
  }
}

}  // namespace
}  // namespace flashjax::sm90

// The sm90 forward's varlen walk (csrc/kernels/sm90/fwd_varlen_scheduler.cuh), simulated on the host: whatever the
// offsets hold, every tile's rows and keys lie inside the packed tensors; the tiles and the fill
// (row_written false) together write every query row, and never the same row twice where the offsets are well
// formed (then a row is the tiles' exactly when it is a used row of some sequence).
#include <gtest/gtest.h>

#include <climits>
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

template <int kBlockM>
void check_walk(const Packing& p, int heads) {
  using Scheduler = FwdVarlenTileSchedulerSm90<kBlockM>;
  AttnShape shape{};
  shape.batch = 1;
  shape.heads_q = shape.heads_k = heads;
  shape.seqlen_q = p.total_q;
  shape.seqlen_k = p.total_k;
  shape.num_seqs = static_cast<int>(p.cu_q.size()) - 1;
  shape.cu_seqlens_q = p.cu_q.data();
  shape.cu_seqlens_k = p.cu_k.data();
  shape.seqused_q = p.used_q.empty() ? nullptr : p.used_q.data();
  shape.seqused_k = p.used_k.empty() ? nullptr : p.used_k.data();
  const typename Scheduler::Params params =
      Scheduler::to_params(shape, FwdQueryTiling<kBlockM, false>(1, p.total_q), /*num_sms=*/7);
  ASSERT_GE(params.num_tiles, 0);
  // The virtual blocks per head: Tq / kBlockM + N, never N x max_seqlen.
  EXPECT_EQ(params.num_blocks, p.total_q / kBlockM + shape.num_seqs);

  std::vector<int> writes(size_t(p.total_q) * heads, 0);
  std::vector<int> visited(params.num_tiles, 0);
  for (int cta = 0; cta < params.grid; ++cta) {
    for (int pos = Scheduler::first_tile(params, cta); pos < params.num_tiles;
         pos = Scheduler::next_tile(params, pos, cta, params.grid)) {
      ++visited[pos];
      const typename Scheduler::Tile tile = Scheduler::tile(params, pos);
      ASSERT_TRUE(tile.head >= 0 && tile.head < heads);
      ASSERT_TRUE(tile.q_start >= 0 && tile.seqlen_q >= 0 && tile.q_start + tile.seqlen_q <= p.total_q);
      ASSERT_TRUE(tile.k_start >= 0 && tile.seqlen_k >= 0 && tile.k_start + tile.seqlen_k <= p.total_k);
      ASSERT_GE(tile.m_block, 0);
      if (!tile.has_rows()) continue;
      // A tile writes its sequence's used rows in [m_block * kBlockM, (m_block + 1) * kBlockM).
      for (int r = tile.m_block * kBlockM; r < std::min((tile.m_block + 1) * kBlockM, tile.seqlen_q); ++r) {
        ++writes[size_t(tile.q_start + r) * heads + tile.head];
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

}  // namespace
}  // namespace flashjax::sm90

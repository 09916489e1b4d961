// The band policies of csrc/kernels/common/band_mask.cuh (forward) and bwd_band_mask.cuh (backward) against the
// docs/design.md §2.3 predicate, brute force on the host: every visible key lies in a visited block, blocks marked
// mask-free are fully visible to every row of the tile, the forward's visiting order is a permutation with the
// masked blocks first, and the forward's per-element mask is exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/bwd_band_mask.cuh"

namespace flashjax::common {
namespace {

bool visible(long long i, long long j, long long sq, long long sk, long long left, long long right) {
  const long long offset = sk - sq;  // 64-bit: the oracle must not overflow on huge windows
  if (j < 0 || j >= sk) return false;
  if (right >= 0 && j > i + offset + right) return false;
  if (left >= 0 && j < i + offset - left) return false;
  return true;
}

template <int kBlockM, int kBlockN>
void expect_band_exact(int sq, int sk, int left, int right) {
  SCOPED_TRACE(::testing::Message() << "Sq " << sq << " Sk " << sk << " window (" << left << ", " << right
                                    << ") tile " << kBlockM << "x" << kBlockN);
  const BandMask band(sq, sk, left, right);
  for (int m_start = 0; m_start < sq; m_start += kBlockM) {
    const KvBlockRange range = band.kv_blocks<kBlockM, kBlockN>(m_start);
    const TileMask mask = band.tile_mask(m_start);
    ASSERT_LE(range.n_block_min, range.n_unmasked_begin);
    ASSERT_LE(range.n_unmasked_begin, range.n_unmasked_end);
    if (!range.empty()) {
      ASSERT_LE(range.n_unmasked_end, range.n_block_max);
      ASSERT_LE(range.n_block_max, (sk + kBlockN - 1) / kBlockN) << "visits a block past Sk";
    }
    std::vector<int> seen(std::max(range.num_blocks(), 0), 0);
    for (int t = 0; t < range.num_blocks(); ++t) {
      const int block = range.block_at(t);
      ASSERT_GE(block, range.n_block_min);
      ASSERT_LT(block, range.n_block_max);
      ++seen[block - range.n_block_min];
      if (t >= range.num_masked()) {
        ASSERT_TRUE(block >= range.n_unmasked_begin && block < range.n_unmasked_end) << "unmasked order, t " << t;
      }
    }
    for (int count : seen) ASSERT_EQ(count, 1) << "block_at is not a permutation";
    for (int i = m_start; i < std::min(m_start + kBlockM, sq); ++i) {
      const int r = i - m_start;
      for (int j = 0; j < sk + kBlockN; ++j) {
        const bool v = visible(i, j, sq, sk, left, right);
        const int block = j / kBlockN;
        const bool visited = !range.empty() && block >= range.n_block_min && block < range.n_block_max;
        const bool mask_free = !range.empty() && block >= range.n_unmasked_begin && block < range.n_unmasked_end;
        ASSERT_TRUE(!v || visited) << "row " << i << " key " << j << " visible but its block is skipped";
        ASSERT_TRUE(v || !mask_free) << "row " << i << " key " << j << " invisible in a mask-free block";
        const bool in_mask = j >= mask.row0_col_lo + r && j < std::min(mask.row0_col_hi + r, mask.seqlen_k);
        ASSERT_EQ(in_mask, v) << "row " << i << " key " << j;
        const int row[1] = {i};
        const RowsMask<1> row_mask = band.rows_mask(row);
        ASSERT_EQ(j >= row_mask.col_lo[0] && j < row_mask.col_hi[0], v) << "rows_mask: row " << i << " key " << j;
      }
    }
    // A tile of rows between two positions that are not a whole aligned tile (a packed GQA tile spans a few
    // positions of several heads): every row's visible keys are visited, and mask-free blocks are all visible.
    const int first = m_start + kBlockM / 4;
    const int last = std::min(m_start + kBlockM / 2, sq - 1);
    if (first > last) continue;
    const KvBlockRange rows_range = band.kv_blocks_of_rows<kBlockN>(first, last);
    for (int i = first; i <= last; ++i) {
      for (int j = 0; j < sk + kBlockN; ++j) {
        const bool v = visible(i, j, sq, sk, left, right);
        const int block = j / kBlockN;
        ASSERT_TRUE(!v || (!rows_range.empty() && block >= rows_range.n_block_min &&
                           block < rows_range.n_block_max))
            << "rows [" << first << ", " << last << "]: row " << i << " key " << j << " visible but skipped";
        ASSERT_TRUE(v || rows_range.empty() || block < rows_range.n_unmasked_begin ||
                    block >= rows_range.n_unmasked_end)
            << "rows [" << first << ", " << last << "]: row " << i << " key " << j << " in a mask-free block";
      }
    }
  }
}

// A random problem for iteration `it`: ragged lengths (some tiny), windows of every kind.
struct RandomBand {
  int sq, sk, left, right;
};
RandomBand random_band(std::mt19937& rng, int it) {
  RandomBand b;
  b.sq = rng() % 300;
  b.sk = rng() % 300;
  if (it % 7 == 0) b.sq = rng() % 5;
  if (it % 11 == 0) b.sk = rng() % 5;
  b.left = rng() % 3 == 0 ? -1 : static_cast<int>(rng() % 400);
  b.right = rng() % 3 == 0 ? -1 : static_cast<int>(rng() % 400);
  if (it % 5 == 0) b.right = 0;          // causal
  if (it % 13 == 0) b.left = rng() % 10;  // narrow windows empty some rows when Sq > Sk
  return b;
}

TEST(BandMask, MatchesThePredicateOnRandomProblems) {
  std::mt19937 rng(20261129);
  for (int it = 0; it < 1500; ++it) {
    const RandomBand b = random_band(rng, it);
    expect_band_exact<128, 64>(b.sq, b.sk, b.left, b.right);
    expect_band_exact<128, 128>(b.sq, b.sk, b.left, b.right);
    expect_band_exact<64, 128>(b.sq, b.sk, b.left, b.right);
    if (HasFatalFailure()) return;
  }
}

// The backward's transposed policy: a CTA owning keys [n_start, n_start + kBlockN) visits M blocks m_blocks(); every
// row that sees one of its keys must lie in them, and a (M block, N block) tile with needs_mask() false must be
// fully visible (rows past Sq excepted: their P is 0 by construction).
template <int kBlockM, int kBlockN>
void expect_bwd_band_exact(int sq, int sk, int left, int right) {
  SCOPED_TRACE(::testing::Message() << "bwd Sq " << sq << " Sk " << sk << " window (" << left << ", " << right
                                    << ") tile " << kBlockM << "x" << kBlockN);
  const BwdBandMask band(sq, sk, left, right);
  for (int n_start = 0; n_start < sk; n_start += kBlockN) {
    const MBlockRange range = band.m_blocks<kBlockM, kBlockN>(n_start);
    ASSERT_GE(range.begin, 0);
    if (range.end > range.begin) ASSERT_LE(range.end, (sq + kBlockM - 1) / kBlockM) << "visits an M block past Sq";
    for (int i = 0; i < sq; ++i) {
      const int block = i / kBlockM;
      const bool visited = block >= range.begin && block < range.end;
      for (int j = n_start; j < std::min(n_start + kBlockN, sk); ++j) {
        ASSERT_TRUE(!visible(i, j, sq, sk, left, right) || visited)
            << "row " << i << " key " << j << " visible but its M block is skipped";
      }
    }
    for (int m = std::max(range.begin, 0); m < range.end; ++m) {
      const int m_start = m * kBlockM;
      if (band.needs_mask<kBlockM, kBlockN>(m_start, n_start)) continue;
      for (int i = m_start; i < std::min(m_start + kBlockM, sq); ++i) {
        for (int j = n_start; j < n_start + kBlockN; ++j) {
          ASSERT_TRUE(visible(i, j, sq, sk, left, right)) << "row " << i << " key " << j << " in a mask-free tile";
        }
      }
    }
  }
}

TEST(BwdBandMask, MatchesThePredicateOnRandomProblems) {
  std::mt19937 rng(20261130);
  for (int it = 0; it < 1000; ++it) {
    const RandomBand b = random_band(rng, it);
    expect_bwd_band_exact<64, 128>(b.sq, b.sk, b.left, b.right);
    expect_bwd_band_exact<64, 64>(b.sq, b.sk, b.left, b.right);
    if (HasFatalFailure()) return;
  }
}

TEST(BandMask, HugeWindowsBehaveAsUnbounded) {
  const BandMask band(1000, 3000, 1 << 30, 1 << 30);
  EXPECT_EQ(band.left, -1);
  EXPECT_EQ(band.right, -1);
  expect_band_exact<128, 64>(1000, 3000, 2147483000, 2147483000);
}

TEST(BandMask, SlidingWindowVisitsOnlyTheBand) {
  // S 16k, window (1024, 0): a 128-row tile must visit about (1024 + 128) / 64 blocks, not all 256.
  const BandMask band(16384, 16384, 1024, 0);
  const KvBlockRange range = band.kv_blocks<128, 64>(8192);
  EXPECT_LE(range.num_blocks(), (1024 + 128) / 64 + 2);
}

// Split keys (KvBlockRange::part): the parts of a tile's range are consecutive, cover it exactly, differ in length
// by at most one block, and classify every block as masked or not as the whole range does (the kernel applies the
// per-element mask to exactly the blocks the range calls masked).
TEST(KvBlockRange, PartsCoverTheRangeAndKeepTheMaskedBlocks) {
  std::mt19937 rng(20261201);
  for (int it = 0; it < 600; ++it) {
    const RandomBand b = random_band(rng, it);
    const BandMask band(b.sq, b.sk, b.left, b.right);
    for (int m_start = 0; m_start < b.sq; m_start += 128) {
      const KvBlockRange whole = band.kv_blocks<128, 64>(m_start);
      auto masked = [](const KvBlockRange& r, int n) { return n < r.n_unmasked_begin || n >= r.n_unmasked_end; };
      for (int parts : {1, 2, 3, 7, 64}) {
        int next = whole.n_block_min;
        for (int p = 0; p < parts; ++p) {
          const KvBlockRange part = whole.part(p, parts);
          ASSERT_EQ(part.n_block_min, next) << "part " << p << " of " << parts;
          ASSERT_LE(part.n_block_min, part.n_block_max);
          ASSERT_LE(part.num_blocks(), whole.num_blocks() / parts + 1);
          ASSERT_TRUE(part.n_block_min <= part.n_unmasked_begin && part.n_unmasked_begin <= part.n_unmasked_end &&
                      part.n_unmasked_end <= part.n_block_max);
          std::vector<int> visited;
          for (int t = 0; t < part.num_blocks(); ++t) visited.push_back(part.block_at(t));
          std::sort(visited.begin(), visited.end());
          for (int t = 0; t < part.num_blocks(); ++t) {
            ASSERT_EQ(visited[t], part.n_block_min + t) << "block_at visits each block of the part once";
            ASSERT_EQ(masked(part, visited[t]), masked(whole, visited[t])) << "block " << visited[t];
          }
          next = part.n_block_max;
        }
        ASSERT_EQ(next, std::max(whole.n_block_max, whole.n_block_min));
      }
    }
  }
}

}  // namespace
}  // namespace flashjax::common

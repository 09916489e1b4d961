// The sm90 backward's query-block lists (csrc/kernels/common/mask_query_block_lists.cuh), checked by brute force on
// the host: random mask bits whose tiles are empty, full or mixed, classified by the tile rule of mask_bits_tiles.cuh
// (restated here element by element), every band the backward sees. For each key block the list must hold, in
// ascending order and once each, exactly the query blocks of the band's range whose tile the bits do not leave
// empty; so every query block with a (row, key) visible to both the band and the bits is listed (the kernel would
// lose gradient otherwise), and a block is unflagged only where the bits are all 1 on the tile's valid rows and keys
// (running it without the bits is then exact). Also the list addressing against the workspace layout.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "flashjax/workspace.h"
#include "kernels/common/bwd_band_mask.cuh"
#include "kernels/common/mask_query_block_lists.cuh"

namespace flashjax::common {
namespace {

struct HostBits {
  int seqlen_q, seqlen_k, words;
  std::vector<uint32_t> bits;  // [Sq, words]
  bool at(int row, int key) const { return (bits[size_t(row) * words + key / 32] >> (key % 32)) & 1u; }
};

// Bits whose (kBlockM x kBlockN) tiles are each all 0, all 1 or random, so that every class occurs.
template <int kBlockM, int kBlockN>
HostBits random_bits(int seqlen_q, int seqlen_k, std::mt19937& rng) {
  HostBits b{seqlen_q, seqlen_k, (seqlen_k + 31) / 32, {}};
  b.bits.assign(size_t(seqlen_q) * b.words, 0u);
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM, n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  std::vector<int> mode(size_t(m_blocks) * n_blocks);
  for (auto& m : mode) m = std::uniform_int_distribution<int>(0, 2)(rng);
  std::bernoulli_distribution coin(0.5);
  for (int i = 0; i < seqlen_q; ++i) {
    for (int j = 0; j < seqlen_k; ++j) {
      const int tile_mode = mode[size_t(i / kBlockM) * n_blocks + j / kBlockN];
      const bool bit = tile_mode == 1 || (tile_mode == 2 && coin(rng));
      if (bit) b.bits[size_t(i) * b.words + j / 32] |= 1u << (j % 32);
    }
  }
  return b;
}

// mask_bits_tiles.cuh's rule: over the tile's rows < Sq and keys < Sk, none set: empty; all set: full.
template <int kBlockM, int kBlockN>
uint8_t classify(const HostBits& b, int m, int n) {
  bool any = false, all = true;
  for (int i = m * kBlockM; i < std::min((m + 1) * kBlockM, b.seqlen_q); ++i) {
    for (int j = n * kBlockN; j < std::min((n + 1) * kBlockN, b.seqlen_k); ++j) {
      any |= b.at(i, j);
      all &= b.at(i, j);
    }
  }
  return !any ? kMaskTileEmpty : all ? kMaskTileFull : kMaskTilePartial;
}

bool band_sees(int i, int j, int seqlen_q, int seqlen_k, int left, int right) {
  const int offset = seqlen_k - seqlen_q;
  return j < seqlen_k && (right < 0 || j <= i + offset + right) && (left < 0 || j >= i + offset - left);
}

template <int kBlockM, int kBlockN>
void check_lists(int seqlen_q, int seqlen_k, int left, int right, std::mt19937& rng) {
  const HostBits b = random_bits<kBlockM, kBlockN>(seqlen_q, seqlen_k, rng);
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM, n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  std::vector<uint8_t> classes(size_t(m_blocks) * n_blocks);  // [m_blocks, n_blocks], as the kernel writes them
  for (int m = 0; m < m_blocks; ++m) {
    for (int n = 0; n < n_blocks; ++n) classes[size_t(m) * n_blocks + n] = classify<kBlockM, kBlockN>(b, m, n);
  }
  const BwdBandMask band(seqlen_q, seqlen_k, left, right);
  for (int n = 0; n < n_blocks; ++n) {
    const std::string where = "Sq " + std::to_string(seqlen_q) + " Sk " + std::to_string(seqlen_k) + " window (" +
                              std::to_string(left) + ", " + std::to_string(right) + ") n-block " + std::to_string(n);
    std::vector<int32_t> list(m_blocks + kBlockListHeader, -7);
    build_query_block_list(band.m_blocks<kBlockM, kBlockN>(n * kBlockN), classes.data() + n, n_blocks, list.data());
    const ListedMBlocks listed{list.data(), list[0]};
    ASSERT_GE(listed.count, 0) << where;
    ASSERT_LE(listed.count, m_blocks) << where;
    std::vector<int> listed_at(m_blocks, -1);  // the position of each m-block in the list
    int partial = 0, previous = -1;
    for (int t = listed.first(); t < listed.last(); ++t) {
      const int m = listed.m_block(t);
      ASSERT_GE(m, 0) << where;
      ASSERT_LT(m, m_blocks) << where;
      EXPECT_GT(m, previous) << where << ": ascending, each block once";
      previous = m;
      listed_at[m] = t;
      EXPECT_EQ(listed.partial(t), classes[size_t(m) * n_blocks + n] == kMaskTilePartial) << where << " m " << m;
      partial += listed.partial(t);
    }
    EXPECT_EQ(list[1], partial) << where;
    for (int i = kBlockListHeader + listed.count; i < m_blocks + kBlockListHeader; ++i) EXPECT_EQ(list[i], -7);
    // Element by element: what the kernel needs of the list.
    for (int m = 0; m < m_blocks; ++m) {
      bool visible = false, band_only_differs = false, nonempty = false;
      for (int i = m * kBlockM; i < std::min((m + 1) * kBlockM, seqlen_q); ++i) {
        for (int j = n * kBlockN; j < std::min((n + 1) * kBlockN, seqlen_k); ++j) {
          const bool in_band = band_sees(i, j, seqlen_q, seqlen_k, left, right);
          visible |= in_band && b.at(i, j);
          band_only_differs |= in_band && !b.at(i, j);
          nonempty |= b.at(i, j);
        }
      }
      const MBlockRange range = band.m_blocks<kBlockM, kBlockN>(n * kBlockN);
      const bool in_range = m >= range.begin && m < range.end;
      if (visible) EXPECT_GE(listed_at[m], 0) << where << ": m-block " << m << " has visible scores, not listed";
      EXPECT_EQ(listed_at[m] >= 0, in_range && nonempty) << where << " m " << m;
      if (listed_at[m] >= 0 && !listed.partial(listed_at[m])) {
        EXPECT_FALSE(band_only_differs) << where << ": m-block " << m << " runs without the bits, which mask some";
      }
    }
  }
}

TEST(MaskQueryBlockLists, HoldTheBandsNonEmptyQueryBlocksInOrder) {
  std::mt19937 rng(3838);
  for (const int seqlen_q : {1, 63, 64, 200, 333}) {
    for (const int seqlen_k : {1, 40, 128, 300}) {
      for (const auto& [left, right] : std::vector<std::pair<int, int>>{{-1, -1}, {-1, 0}, {40, 7}, {100, 0},
                                                                         {0, 0}, {-1, 50}}) {
        check_lists<64, 128>(seqlen_q, seqlen_k, left, right, rng);  // the sm90 backward's tiles at D <= 128
        check_lists<64, 64>(seqlen_q, seqlen_k, left, right, rng);   // and at D > 128
      }
    }
  }
}

// Sq = 0: the band's range is empty, so the list is (count 0), and no class is read (there are none).
TEST(MaskQueryBlockLists, NoQueryRowsGiveEmptyLists) {
  const BwdBandMask band(0, 300, -1, -1);
  std::vector<int32_t> list(kBlockListHeader, -7);
  build_query_block_list(band.m_blocks<64, 128>(128), nullptr, 3, list.data());
  EXPECT_EQ(list[0], 0);
  EXPECT_EQ(list[1], 0);
}

// Where the kernel finds the list of (b, h, n-block), for per-batch-and-head bits and broadcast ones: inside the
// workspace's list part (MaskBlockLists::kQueryBlocks), one list per (b, h, n-block), at the index the list builder
// writes (((b * Hm + h) * n_blocks + n) lists in), with the classes right after.
TEST(MaskQueryBlockLists, AddressesMatchTheWorkspaceLayout) {
  constexpr int kB = 3, kH = 5, kSq = 300, kSk = 500;
  const MaskTileClassesLayout layout =
      mask_tile_classes_layout(kB, kH, kSq, kSk, 64, 128, MaskBlockLists::kQueryBlocks);
  ASSERT_EQ(layout.m_blocks, 5);
  ASSERT_EQ(layout.n_blocks, 4);
  EXPECT_EQ(layout.list_bytes, int64_t(kB) * kH * 4 * (5 + 2) * 4);
  EXPECT_EQ(layout.bytes, layout.list_bytes + int64_t(kB) * kH * 5 * 4);
  EXPECT_EQ(layout.head_bytes() * kB * kH, layout.bytes);
  std::vector<uint8_t> workspace(layout.bytes);
  AttnShape s;
  s.batch = kB;
  s.heads_q = kH;
  s.seqlen_q = kSq;
  s.seqlen_k = kSk;
  s.mask_words = (kSk + 31) / 32;
  s.mask_block_lists = layout.block_lists(workspace.data());
  s.mask_tile_classes = layout.tile_classes(workspace.data());
  ASSERT_EQ(reinterpret_cast<uint8_t*>(s.mask_block_lists), workspace.data());
  using Lists = MaskQueryBlockLists<64, 128>;
  for (const auto& [batch_stride, head_stride] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {0, 1}, {1, 0},
                                                                                          {0, 0}}) {
    s.mask_batch_stride = batch_stride;  // only whether the stride is 0 matters here
    s.mask_head_stride = head_stride;
    const int hm = head_stride != 0 ? kH : 1;
    for (int b = 0; b < kB; ++b) {
      for (int h = 0; h < kH; ++h) {
        for (int n = 0; n < 4; ++n) {
          const int64_t index = ((int64_t(batch_stride != 0 ? b : 0) * hm + (head_stride != 0 ? h : 0)) * 4 + n);
          const int32_t* list = Lists::list(s, b, h, n);
          EXPECT_EQ(list, s.mask_block_lists + index * Lists::list_length(s));
          EXPECT_LE(reinterpret_cast<const uint8_t*>(list + Lists::list_length(s)), s.mask_tile_classes);
          // The kernel steps from head_begin's list to head h's by head_stride.
          EXPECT_EQ(Lists::list(s, b, 0, n) + h * Lists::head_stride(s), list);
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashjax::common

// A mask mod's block lists (csrc/kernels/common/mask_block_lists.cuh), built on the host from random tile classes and
// every band the sm90 forward sees: the list holds exactly the band's blocks that are not empty, each once; its
// masked section exactly those the band masks or the bits leave partial, in the band's visiting order; the rest are
// full blocks the band leaves unmasked, in that order too. The kernel walks the list as it walks a KvBlockRange, so
// this is what makes it visit the same blocks as the mask-mod reference with the empty ones skipped.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/mask_block_lists.cuh"

namespace flashjax::common {
namespace {

template <int kBlockM, int kBlockN>
void check_lists(int seqlen_q, int seqlen_k, int left, int right, std::mt19937& rng) {
  const BandMask band(seqlen_q, seqlen_k, left, right);
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM, n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  std::uniform_int_distribution<int> klass(0, 2);
  for (int m = 0; m < m_blocks; ++m) {
    std::vector<uint8_t> classes(n_blocks);
    for (auto& c : classes) c = static_cast<uint8_t>(klass(rng));
    std::vector<int32_t> list(n_blocks + kBlockListHeader, -1);
    const KvBlockRange range = band.kv_blocks<kBlockM, kBlockN>(m * kBlockM);
    build_block_list(range, classes.data(), list.data());
    ListedKvBlocks listed{list.data(), list[0], list[1]};

    std::vector<int> expect_masked, expect_full;
    for (int t = 0; t < range.num_blocks(); ++t) {
      const int block = range.block_at(t);
      ASSERT_GE(block, 0);
      ASSERT_LT(block, n_blocks);
      if (classes[block] == kMaskTileEmpty) continue;
      if (t < range.num_masked() || classes[block] == kMaskTilePartial) {
        expect_masked.push_back(block);
      } else {
        expect_full.push_back(block);
      }
    }
    ASSERT_EQ(listed.num_masked(), static_cast<int>(expect_masked.size())) << "m-block " << m;
    ASSERT_EQ(listed.num_blocks(), static_cast<int>(expect_masked.size() + expect_full.size())) << "m-block " << m;
    EXPECT_EQ(listed.empty(), listed.num_blocks() == 0);
    std::set<int> seen;
    for (int t = 0; t < listed.num_blocks(); ++t) {
      const int block = listed.block_at(t);
      EXPECT_TRUE(seen.insert(block).second) << "block " << block << " listed twice";
      const int want = t < listed.num_masked() ? expect_masked[t] : expect_full[t - listed.num_masked()];
      EXPECT_EQ(block, want) << "m-block " << m << ", position " << t;
      EXPECT_NE(classes[block], kMaskTileEmpty);
    }
    // Nothing is written past the list's own entries (the rest of the row keeps what it held).
    for (int i = kBlockListHeader + listed.num_blocks(); i < n_blocks + kBlockListHeader; ++i) EXPECT_EQ(list[i], -1);
  }
}

TEST(MaskBlockLists, HoldTheBandsNonEmptyBlocksMaskedFirst) {
  std::mt19937 rng(38);
  for (const int seqlen_q : {1, 77, 128, 300, 1000}) {
    for (const int seqlen_k : {0, 1, 130, 512, 999}) {
      for (const auto& [left, right] : std::vector<std::pair<int, int>>{{-1, -1}, {-1, 0}, {32, 7}, {200, 0},
                                                                         {0, 0}}) {
        check_lists<128, 128>(seqlen_q, seqlen_k, left, right, rng);
        check_lists<128, 64>(seqlen_q, seqlen_k, left, right, rng);
      }
    }
  }
}

// All-full classes give the band's own walk: the band-masked blocks are the masked section, the bulk the rest.
TEST(MaskBlockLists, AllFullClassesGiveTheBandsWalk) {
  const BandMask band(1000, 1000, -1, 0);
  for (int m = 0; m < 8; ++m) {
    std::vector<uint8_t> classes(8, kMaskTileFull);
    std::vector<int32_t> list(8 + kBlockListHeader);
    const KvBlockRange range = band.kv_blocks<128, 128>(m * 128);
    build_block_list(range, classes.data(), list.data());
    ASSERT_EQ(list[0], range.num_blocks());
    ASSERT_EQ(list[1], range.num_masked());
    for (int t = 0; t < range.num_blocks(); ++t) EXPECT_EQ(list[kBlockListHeader + t], range.block_at(t));
  }
}

}  // namespace
}  // namespace flashjax::common

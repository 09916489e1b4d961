// The sm90 forward's per-call choices (csrc/kernels/sm90/fwd_choices.cuh): key splits, GQA packing and the tile
// class by key load, with the numbers of the rules' comments (an H100/H200 has 132 SMs).
#include <gtest/gtest.h>

#include "kernels/sm90/fwd_choices.cuh"

namespace flashjax::sm90 {
namespace {

constexpr int kAuto = -1;

int splits(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_k, int head_dim = 128, int window_left = -1,
           int num_sms = 132) {
  return fwd_num_splits(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, window_left, num_sms, kAuto);
}

TEST(Sm90SplitKeys, SplitsWhereTilesFillAtMostHalfTheSms) {
  EXPECT_EQ(splits(1, 1, 8192, 32, 8), 16);               // 8 packed tiles, 64 blocks of 128 keys
  EXPECT_EQ(splits(1, 1, 32768, 16, 16), 8);              // 16 tiles
  EXPECT_EQ(splits(1, 1, 4000, 8, 8, 256), 12);           // 50 blocks of 80 keys
  EXPECT_EQ(splits(2, 16, 5000, 16, 2), 10);              // 4 tiles, 40 blocks
  EXPECT_EQ(splits(1, 1, 8192, 32, 8, 128, -1, 78), 9);   // a smaller GPU
  for (const int whole : {splits(64, 1, 8192, 32, 8), splits(1, 1, 500, 32, 8), splits(1, 4096, 4096, 16, 16),
                          splits(1, 64, 8192, 32, 8, 128, 100), splits(1, 1, 8192, 32, 8, 128, -1, 0),
                          splits(1, 1, 0, 32, 8), splits(0, 1, 8192, 32, 8)}) {
    EXPECT_EQ(whole, 1);
  }
}

TEST(Sm90SplitKeys, ModesForceOrForbid) {
  EXPECT_EQ(fwd_num_splits(64, 4096, 4096, 16, 16, 128, -1, 132, 5), 5);
  EXPECT_EQ(fwd_num_splits(1, 1, 8192, 32, 8, 128, -1, 0, 5), 5);  // forced even without an SM count
  EXPECT_EQ(fwd_num_splits(1, 1, 8192, 32, 8, 128, -1, 132, 0), 1);
}

TEST(Sm90PackGqa, PacksWhereAQuarterOfTheTilesGoes) {
  EXPECT_EQ(fwd_pack_group(1, 32, 8, PackGqaMode::kAuto), 4);
  EXPECT_EQ(fwd_pack_group(60, 16, 2, PackGqaMode::kAuto), 8);
  EXPECT_EQ(fwd_pack_group(129, 32, 8, PackGqaMode::kAuto), 4);  // 5 packed tiles per KV head against 8
  for (const int seqlen_q : {4000, 128, 97}) EXPECT_EQ(fwd_pack_group(seqlen_q, 32, 8, PackGqaMode::kAuto), 1);
  EXPECT_EQ(fwd_pack_group(200, 32, 4, PackGqaMode::kAuto), 1);
  EXPECT_EQ(fwd_pack_group(1, 16, 16, PackGqaMode::kAuto), 1);
  EXPECT_EQ(fwd_pack_group(4000, 32, 8, PackGqaMode::kAlways), 4);
  EXPECT_EQ(fwd_pack_group(1, 32, 8, PackGqaMode::kNever), 1);
}

AttnShape shape(int batch, int sq, int sk, int hq, int hk, int left = -1, int right = -1) {
  AttnShape s{};
  s.batch = batch;
  s.seqlen_q = sq;
  s.seqlen_k = sk;
  s.heads_q = hq;
  s.heads_k = hk;
  s.head_dim = 128;
  s.window_left = left;
  s.window_right = right;
  return s;
}

TEST(Sm90Choices, TheKeyLoadPicksTheTiles) {
  EXPECT_EQ(key_load(shape(1, 100, 4096, 8, 8)), FwdKeyLoad::kFew);  // one tile of queries
  EXPECT_EQ(key_load(shape(1, 4096, 4096, 8, 8)), FwdKeyLoad::kMany);
  EXPECT_EQ(key_load(shape(1, 512, 512, 8, 8)), FwdKeyLoad::kManyShortRows);
  EXPECT_EQ(key_load(shape(1, 4096, 4096, 8, 8, -1, 0)), FwdKeyLoad::kMany);       // the middle row sees 2048
  EXPECT_EQ(key_load(shape(1, 2048, 2048, 8, 8, -1, 0)), FwdKeyLoad::kFew);        // 1024
  EXPECT_EQ(key_load(shape(1, 16384, 16384, 8, 8, 255, 0)), FwdKeyLoad::kFewShortBand);
  EXPECT_EQ(key_load(shape(1, 512, 512, 8, 8, 4096, 4096)), FwdKeyLoad::kManyShortRows);  // the window is no band
}

TEST(Sm90Choices, SplitCallsPackAndTakeTheFewTiles) {
  if (!setting_text(Setting::kSm90SplitKv).empty() || !setting_text(Setting::kSm90PackGqa).empty()) {
    GTEST_SKIP() << "a FLASHJAX_SM90_* setting is set in this environment";
  }
  ChoiceQuery query;
  query.num_sms = 132;
  query.explain = true;
  const FamilyChoices split = fwd_choices_for(128, shape(1, 1, 8192, 32, 8), query);
  EXPECT_EQ(split.num_splits, 16);
  EXPECT_EQ(split.pack_group, 4);
  EXPECT_EQ(split.tile_class, static_cast<int>(FwdKeyLoad::kFew));
  EXPECT_NE(split.split_reason.find("run as 16 parts"), std::string::npos) << split.split_reason;
  EXPECT_NE(split.packing_reason.find("the 4 query heads of a KV head share each forward tile"), std::string::npos);
  query.num_splits = 1;  // the plain target's: whatever the rule says
  const FamilyChoices packed = fwd_choices_for(128, shape(1, 1, 8192, 32, 8), query);
  EXPECT_EQ(packed.num_splits, 1);
  EXPECT_EQ(packed.pack_group, 4);
  const FamilyChoices many = fwd_choices_for(128, shape(2, 4096, 4096, 16, 16), query);
  EXPECT_EQ(many.pack_group, 1);
  EXPECT_EQ(many.tile_class, static_cast<int>(FwdKeyLoad::kMany));
  EXPECT_EQ(many.block_m, 128);
  EXPECT_EQ(many.block_n, 128);
  EXPECT_EQ(fwd_choices_for(64, shape(2, 4096, 4096, 16, 16), query).block_m, 192);
  query.explain = false;
  EXPECT_TRUE(fwd_choices_for(128, shape(2, 4096, 4096, 16, 16), query).tile_reason.empty());
}

// Varlen takes the varlen kernel whatever the token counts and the settings: kFew's tiles, unsplit
// (fwd_launch.cuh's FwdVarlenKernel), asked through the query (the plan's shape has no offsets) or the shape's own;
// GQA packed by the dense rule at the mean query length ceil(Tq / N).
TEST(Sm90Choices, VarlenTakesTheVarlenKernel) {
  ChoiceQuery query;
  query.num_sms = 132;
  query.explain = true;
  query.varlen = true;
  for (const int head_dim : {64, 96, 128, 192, 256}) {
    // Decode-shaped (the dense rule would pack and split: varlen packs) and long (the dense rule would take kMany's
    // tiles).
    for (const AttnShape& call : std::initializer_list<AttnShape>{shape(64, 64, 200000, 32, 8),
                                                                  shape(3, 40000, 40000, 16, 16)}) {
      const FamilyChoices c = fwd_choices_for(head_dim, call, query);
      EXPECT_EQ(c.num_splits, 1);
      EXPECT_EQ(c.pack_group, call.heads_q == 32 ? 4 : 1);
      EXPECT_EQ(c.tile_class, static_cast<int>(FwdKeyLoad::kFew));
      EXPECT_EQ(c.block_m, fwd_tile_sizes(head_dim, FwdKeyLoad::kFew).block_m);
      EXPECT_EQ(c.block_n, fwd_tile_sizes(head_dim, FwdKeyLoad::kFew).block_n);
      EXPECT_NE(c.tile_reason.find("varlen"), std::string::npos) << c.tile_reason;
      EXPECT_NE(c.split_reason.find("varlen"), std::string::npos) << c.split_reason;
    }
  }
  // Mean query length 64 at GQA 4: 2 packed tiles against 4 unpacked: packed. 4 sequences of 1000 tokens: not.
  EXPECT_NE(fwd_choices_for(128, shape(1, 64, 9000, 32, 8), query).packing_reason.find("varlen tile"),
            std::string::npos);
  const FamilyChoices long_rows = fwd_choices_for(128, shape(4, 4000, 4000, 32, 8), query);
  EXPECT_EQ(long_rows.pack_group, 1);
  EXPECT_NE(long_rows.packing_reason.find("unpacked"), std::string::npos);
  const int32_t offsets[] = {0, 64};
  AttnShape own = shape(1, 64, 9000, 32, 8);
  own.cu_seqlens_q = own.cu_seqlens_k = offsets;
  own.num_seqs = 1;
  query.varlen = false;
  EXPECT_EQ(fwd_choices_for(128, own, query).pack_group, 4);
  own.heads_q = own.heads_k = 8;
  EXPECT_EQ(fwd_choices_for(128, own, query).pack_group, 1);
}

}  // namespace
}  // namespace flashjax::sm90

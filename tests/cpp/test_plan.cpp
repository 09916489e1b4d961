// The plan of a call (csrc/ffi/plan.h) over a small fake kernel table: both passes planned, the head width padded,
// the family's choices asked with the call's shape and the lowering's split count, the workspace sized, each refusal
// explained, and the JSON Python reads.
#include <gtest/gtest.h>

#include "ffi/plan.h"
#include "flashjax/mask_grid.h"
#include "flashjax/workspace.h"

namespace flashjax {
namespace {

// A family whose forward splits keys into the fixed count when given one, else into 3 parts when the device has
// more than 100 SMs; it records what it was asked.
AttnShape g_seen_shape;
ChoiceQuery g_seen_query;
FamilyChoices fake_fwd_choices(const AttnShape& shape, const ChoiceQuery& query) {
  g_seen_shape = shape;
  g_seen_query = query;
  FamilyChoices c;
  c.tile_class = 2;
  c.block_m = 128;
  c.block_n = 64;
  c.num_splits = query.num_splits >= 1 ? query.num_splits : query.num_sms > 100 ? 3 : 1;
  c.pack_group = c.num_splits > 1 ? shape.heads_q / shape.heads_k : 1;
  if (query.explain) c.tile_reason = "fake \"tiles\"";
  return c;
}

FamilyChoices fake_bwd_choices(const AttnShape&, const ChoiceQuery&) {
  FamilyChoices c;
  c.block_m = 64;
  c.block_n = 128;
  return c;
}

KernelEntry entry(Direction d, DType t, int hdim, int smem = 48 * 1024) {
  return {"sm80", d, t, hdim, false, smem, nullptr, d == Direction::kFwd ? fake_fwd_choices : fake_bwd_choices,
          /*deterministic=*/false, /*varlen=*/true, /*mask_mod=*/true, /*varlen_mask_mod=*/true};
}

class PlanCall : public ::testing::Test {
 protected:
  std::vector<KernelEntry> table = {
      entry(Direction::kFwd, DType::kBFloat16, 128),
      entry(Direction::kBwd, DType::kBFloat16, 128),
      entry(Direction::kFwd, DType::kFloat16, 64),  // no fp16 backward: calls of it take the reference
      entry(Direction::kFwd, DType::kBFloat16, 256),
      entry(Direction::kBwd, DType::kBFloat16, 256, 150 * 1024),  // over a 99 KB GPU's limit
  };
  std::vector<std::string> archs = {"80-real"};
  Problem problem() {
    Problem p;
    p.batch = 2;
    p.seqlen_q = 300;
    p.seqlen_k = 500;
    p.heads_q = 8;
    p.heads_k = 2;
    p.head_dim = 100;
    return p;
  }
  DeviceProps device(int sm = 80, int num_sms = 108) {
    DeviceProps d;
    d.sm = sm;
    d.num_sms = num_sms;
    return d;
  }
};

TEST_F(PlanCall, PlansBothPassesAtThePaddedWidth) {
  const Plan plan = plan_call(problem(), device(), table, archs);
  EXPECT_TRUE(plan.runs()) << plan.reason;
  EXPECT_EQ(plan.head_dim, 128);
  ASSERT_NE(plan.fwd.kernel, nullptr);
  ASSERT_NE(plan.bwd.kernel, nullptr);
  EXPECT_EQ(plan.fwd.kernel, &table[0]);
  EXPECT_EQ(plan.bwd.kernel, &table[1]);
  EXPECT_EQ(plan.device.smem_per_block_optin, 163 * 1024);  // the table's figure for sm80
  EXPECT_EQ(plan.reason, plan.fwd.reason);
  EXPECT_NE(plan.fwd.reason.find("sm80 forward kernel"), std::string::npos) << plan.fwd.reason;
  EXPECT_EQ(plan.fwd.choices.tile_reason, "fake \"tiles\"");
  EXPECT_EQ(plan.bwd.choices.block_n, 128);
}

TEST_F(PlanCall, TheFamilySeesTheCallAtItsCompiledWidth) {
  Problem p = problem();
  p.window_left = 16;
  p.window_right = 0;
  p.softcap = 5.f;
  plan_call(p, device(80, 132), table, archs);
  EXPECT_EQ(g_seen_shape.head_dim, 128);
  EXPECT_EQ(g_seen_shape.seqlen_q, 300);
  EXPECT_EQ(g_seen_shape.seqlen_k, 500);
  EXPECT_EQ(g_seen_shape.heads_q, 8);
  EXPECT_EQ(g_seen_shape.window_left, 16);
  EXPECT_EQ(g_seen_shape.window_right, 0);
  EXPECT_EQ(g_seen_shape.softcap, 5.f);
  EXPECT_EQ(g_seen_query.num_sms, 132);
  EXPECT_EQ(g_seen_query.num_splits, 0);
  EXPECT_TRUE(g_seen_query.explain);
}

TEST_F(PlanCall, SplitsComeWithTheirWorkspace) {
  const Plan split = plan_call(problem(), device(80, 132), table, archs);
  EXPECT_EQ(split.fwd.choices.num_splits, 3);
  EXPECT_EQ(split.fwd.choices.pack_group, 4);
  ASSERT_EQ(split.fwd.workspace.size(), 2u);
  EXPECT_STREQ(split.fwd.workspace[0].name, "o_partial");
  EXPECT_EQ(split.fwd.workspace[0].shape, (std::vector<int64_t>{2, 3, 8, 300, 128}));
  EXPECT_EQ(split.fwd.workspace[1].shape, (std::vector<int64_t>{2, 3, 8, 300}));
  const Plan whole = plan_call(problem(), device(80, 100), table, archs);
  EXPECT_EQ(whole.fwd.choices.num_splits, 1);
  EXPECT_TRUE(whole.fwd.workspace.empty());
}

TEST_F(PlanCall, TheBackwardAlwaysHasItsWorkspace) {
  const Plan plan = plan_call(problem(), device(), table, archs);
  ASSERT_EQ(plan.bwd.workspace.size(), 3u);
  EXPECT_STREQ(plan.bwd.workspace[0].name, "dq_accum");
  EXPECT_EQ(plan.bwd.workspace[0].shape, (std::vector<int64_t>{2, 8, 384, 128}));  // Sq rounded up to 128 rows
  EXPECT_EQ(plan.bwd.workspace[1].shape, (std::vector<int64_t>{2, 8, 384}));
  EXPECT_EQ(plan.bwd.workspace[2].shape, (std::vector<int64_t>{2, 8, 384}));
}

// Varlen (batch = N sequences, seqlen_q = Tq tokens): both passes on the sm80 family, the backward's workspace one
// slab per query head of (Tq / 64 + N) * 64 rows rounded up to 128 (flashjax/workspace.h), never N x max_seqlen.
TEST_F(PlanCall, VarlenRunsBothPassesWithAPackedWorkspace) {
  Problem varlen = problem();
  varlen.varlen = true;
  varlen.batch = 5;  // N
  const Plan plan = plan_call(varlen, device(), table, archs);
  ASSERT_TRUE(plan.runs()) << plan.reason;
  EXPECT_NE(plan.bwd.reason.find("varlen"), std::string::npos) << plan.bwd.reason;
  ASSERT_EQ(plan.bwd.workspace.size(), 3u);
  // (300 / 64 + 5) * 64 = 576 rows, rounded up to 640.
  EXPECT_EQ(plan.bwd.workspace[0].shape, (std::vector<int64_t>{8, 640, 128}));
  EXPECT_EQ(plan.bwd.workspace[1].shape, (std::vector<int64_t>{8, 640}));
  EXPECT_EQ(plan.bwd.workspace[2].shape, (std::vector<int64_t>{8, 640}));
}

TEST_F(PlanCall, AFixedSplitCountIsTheLowerings) {
  Problem p = problem();
  p.num_splits = 5;
  const PassPlan pass = plan_pass(Direction::kFwd, p, device(80, 0), table, archs, false);
  ASSERT_NE(pass.kernel, nullptr);
  EXPECT_EQ(g_seen_query.num_splits, 5);
  EXPECT_FALSE(g_seen_query.explain);
  EXPECT_EQ(pass.choices.num_splits, 5);
  EXPECT_TRUE(pass.reason.empty());  // the handlers' path: no reasons for a choice that succeeds
  EXPECT_TRUE(pass.choices.tile_reason.empty());
  // The backward never splits, whatever the forward's lowering chose.
  plan_pass(Direction::kBwd, p, device(), table, archs, false);
}

TEST_F(PlanCall, ACallWithoutABackwardKernelTakesTheReference) {
  Problem p = problem();
  p.dtype = DType::kFloat16;
  p.head_dim = 64;
  const Plan plan = plan_call(p, device(), table, archs);
  EXPECT_NE(plan.fwd.kernel, nullptr);
  EXPECT_EQ(plan.bwd.kernel, nullptr);
  EXPECT_FALSE(plan.runs());
  EXPECT_EQ(plan.reason, plan.bwd.reason);
  EXPECT_NE(plan.reason.find("no backward kernel for fp16 head dim 64"), std::string::npos) << plan.reason;
}

TEST_F(PlanCall, SharedMemoryOfTheDeviceDecides) {
  Problem p = problem();
  p.head_dim = 256;
  EXPECT_TRUE(plan_call(p, device(80), table, archs).runs());
  const Plan small = plan_call(p, device(86), table, archs);
  EXPECT_FALSE(small.runs());
  EXPECT_NE(small.reason.find("needs 150 KB of shared memory per block; sm_86 allows 99 KB"), std::string::npos)
      << small.reason;
  DeviceProps measured = device(80);
  measured.smem_per_block_optin = 100 * 1024;  // the handler's figure, the device's own attribute
  EXPECT_FALSE(plan_call(p, measured, table, archs).runs());
}

TEST_F(PlanCall, DeterministicBackwardTakesARowThatOrdersItsSumsWithItsCounters) {
  KernelEntry ordered = entry(Direction::kBwd, DType::kBFloat16, 128);
  ordered.family = "sm90";
  ordered.arch_specific = true;
  ordered.deterministic = true;
  table.push_back(ordered);
  archs = {"80-real", "90a-real"};
  Problem p = problem();
  p.deterministic = true;
  const Plan on_hopper = plan_call(p, device(90), table, archs);
  ASSERT_TRUE(on_hopper.runs()) << on_hopper.reason;
  EXPECT_STREQ(on_hopper.bwd.kernel->family, "sm90");
  ASSERT_EQ(on_hopper.bwd.workspace.size(), 4u);
  EXPECT_STREQ(on_hopper.bwd.workspace[3].name, "dq_semaphore");
  EXPECT_STREQ(on_hopper.bwd.workspace[3].dtype, "int32");
  EXPECT_EQ(on_hopper.bwd.workspace[3].shape, (std::vector<int64_t>{2, 8, 384 / 64}));
  const Plan on_ampere = plan_call(p, device(80), table, archs);  // the unordered sm80 row alone runs there
  EXPECT_FALSE(on_ampere.runs());
  EXPECT_NE(on_ampere.reason.find("deterministic=True"), std::string::npos) << on_ampere.reason;
  p.deterministic = false;
  EXPECT_EQ(plan_call(p, device(90), table, archs).bwd.workspace.size(), 3u);
}

TEST_F(PlanCall, RefusalsAreExplained) {
  Problem deterministic = problem();
  deterministic.deterministic = true;
  const Plan d = plan_call(deterministic, device(), table, archs);
  EXPECT_NE(d.fwd.kernel, nullptr);  // the forward does not depend on it
  EXPECT_FALSE(d.runs());
  EXPECT_NE(d.reason.find("deterministic=True"), std::string::npos) << d.reason;
  Problem wide = problem();
  wide.head_dim = 264;
  const Plan w = plan_call(wide, device(), table, archs);
  EXPECT_FALSE(w.runs());
  EXPECT_EQ(w.head_dim, 0);
  EXPECT_NE(w.reason.find("head dim 264"), std::string::npos) << w.reason;
  Problem bad_heads = problem();
  bad_heads.heads_k = 3;
  EXPECT_FALSE(plan_call(bad_heads, device(), table, archs).runs());
  EXPECT_NE(plan_call(problem(), device(70), table, archs).reason.find("no code for sm_70"), std::string::npos);
}

TEST_F(PlanCall, JsonCarriesEveryDecision) {
  const std::string json = plan_json(plan_call(problem(), device(80, 132), table, archs));
  for (const char* field :
       {"\"runs\": true", "\"head_dim\": 128", "\"sm\": 80", "\"smem_per_block_optin\": 166912", "\"num_sms\": 132",
        "\"family\": \"sm80\", \"smem_bytes\": 49152",
        "\"num_splits\": 3", "\"pack_group\": 4", "\"tile_class\": 2", "\"block_n\": 64",
        "\"tile_reason\": \"fake \\\"tiles\\\"\"",
        "{\"name\": \"o_partial\", \"shape\": [2, 3, 8, 300, 128], \"dtype\": \"float32\"}",
        "{\"name\": \"dq_accum\", \"shape\": [2, 8, 384, 128], \"dtype\": \"float32\"}"}) {
    EXPECT_NE(json.find(field), std::string::npos) << field << " in " << json;
  }
  Problem p = problem();
  p.dtype = DType::kFloat16;
  p.head_dim = 64;
  EXPECT_NE(plan_json(plan_call(p, device(), table, archs)).find("\"runs\": false"), std::string::npos);
}

}  // namespace
// A mask mod's passes end their workspace with the uint8 tile classes of their own tiles ([B, Hq, m-blocks, n-blocks]
// of the family's block_m x block_n: forward 128 x 64, backward 64 x 128 here), after the backward's f32 buffers.
TEST_F(PlanCall, MaskModPassesCarryTheirTileClasses) {
  Problem p = problem();
  p.mask_mod = true;
  const Plan plan = plan_call(p, device(80, 0), table, archs);
  ASSERT_TRUE(plan.runs()) << plan.reason;
  ASSERT_EQ(plan.fwd.workspace.size(), 1u);
  EXPECT_STREQ(plan.fwd.workspace[0].name, "mask_tile_classes");
  EXPECT_STREQ(plan.fwd.workspace[0].dtype, "uint8");
  EXPECT_EQ(plan.fwd.workspace[0].shape, (std::vector<int64_t>{2, 8, 3, 8}));  // ceil(300/128), ceil(500/64)
  ASSERT_EQ(plan.bwd.workspace.size(), 4u);
  EXPECT_STREQ(plan.bwd.workspace[3].name, "mask_tile_classes");
  EXPECT_EQ(plan.bwd.workspace[3].shape, (std::vector<int64_t>{2, 8, 5, 4}));  // ceil(300/64), ceil(500/128)
  EXPECT_EQ(plan.tangent.kernel, nullptr);  // this table has no tangent row: jvp of a mask mod runs the reference's
  EXPECT_TRUE(plan.tangent.workspace.empty());
}

// Varlen with a mask mod: the classes cover the bits' grid, the N sequences padded to the hints (mask_grid.h: rows
// max_seqlen_q, keys the bits' whole words), not the token counts; so does a handler's problem (problem_of).
TEST_F(PlanCall, VarlenMaskModClassesCoverThePaddedSequences) {
  Problem p = problem();  // N = 2 sequences in 300 query and 500 key tokens
  p.varlen = p.mask_mod = true;
  p.mask_seqlen_q = 200;
  p.mask_seqlen_k = 70;  // 3 words: 96 keys
  const Plan plan = plan_call(p, device(80, 0), table, archs);
  ASSERT_TRUE(plan.runs()) << plan.reason;
  ASSERT_EQ(plan.fwd.workspace.size(), 1u);
  EXPECT_EQ(plan.fwd.workspace[0].shape, (std::vector<int64_t>{2, 8, 2, 2}));  // ceil(200/128), ceil(96/64)
  ASSERT_EQ(plan.bwd.workspace.size(), 4u);
  EXPECT_STREQ(plan.bwd.workspace[3].name, "mask_tile_classes");
  EXPECT_EQ(plan.bwd.workspace[3].shape, (std::vector<int64_t>{2, 8, 4, 1}));  // ceil(200/64), ceil(96/128)

  AttnShape shape;
  shape.batch = 1;
  shape.seqlen_q = 300;
  shape.seqlen_k = 500;
  shape.heads_q = 8;
  shape.heads_k = 2;
  shape.head_dim = 128;
  const int32_t offsets[3] = {0, 100, 300};
  shape.cu_seqlens_q = shape.cu_seqlens_k = offsets;
  shape.num_seqs = 2;
  const uint32_t bits[1] = {};
  shape.mask_bits = bits;
  shape.mask_seqlen_q = 200;
  shape.mask_words = 3;
  const Problem decoded = problem_of(shape, false, 1);
  EXPECT_EQ(decoded.batch, 2);
  EXPECT_EQ(decoded.mask_seqlen_q, 200);
  EXPECT_EQ(decoded.mask_seqlen_k, 96);
  const AttnShape grid = mask_bits_grid(shape);
  EXPECT_EQ(grid.batch, 2);
  EXPECT_EQ(grid.seqlen_q, 200);
  EXPECT_EQ(grid.seqlen_k, 96);
  EXPECT_EQ(grid.cu_seqlens_q, nullptr);
  int used_q = 250, used_k = 90;  // a sequence longer than the rows: cut; its keys fit
  cut_to_mask_grid(shape, used_q, used_k);
  EXPECT_EQ(used_q, 200);
  EXPECT_EQ(used_k, 90);
  used_k = 1000;
  cut_to_mask_grid(shape, used_q, used_k);
  EXPECT_EQ(used_k, 96);
  shape.cu_seqlens_q = nullptr;  // dense: the shape is its own grid, nothing is cut
  EXPECT_EQ(mask_bits_grid(shape).seqlen_q, 300);
  used_q = 250;
  used_k = 1000;
  cut_to_mask_grid(shape, used_q, used_k);
  EXPECT_EQ(used_q, 250);
  EXPECT_EQ(used_k, 1000);
}

// A family that walks block lists (the sm90 forward) asks for them with its choices; the pass's one uint8 workspace
// then holds the int32 lists [B, Hq, m-blocks, n-blocks + 2] first and the classes after: rows of 4 (n + 2) + n
// bytes, whose total is what mask_tile_classes_layout counts.
FamilyChoices fake_listing_fwd_choices(const AttnShape& shape, const ChoiceQuery& query) {
  FamilyChoices c = fake_fwd_choices(shape, query);
  c.num_splits = 1;
  c.pack_group = 1;
  c.mask_block_lists = query.mask_mod ? MaskBlockLists::kKeyBlocks : MaskBlockLists::kNone;
  return c;
}

TEST_F(PlanCall, MaskModForwardsThatWalkListsCarryThemAheadOfTheClasses) {
  for (KernelEntry& e : table) {
    if (e.direction == Direction::kFwd) e.choices = fake_listing_fwd_choices;
  }
  Problem p = problem();
  p.mask_mod = true;
  const Plan plan = plan_call(p, device(80, 0), table, archs);
  ASSERT_TRUE(plan.runs()) << plan.reason;
  EXPECT_TRUE(g_seen_query.mask_mod);
  ASSERT_EQ(plan.fwd.workspace.size(), 1u);
  EXPECT_STREQ(plan.fwd.workspace[0].name, "mask_tile_classes");
  EXPECT_EQ(plan.fwd.workspace[0].shape, (std::vector<int64_t>{2, 8, 3, 4 * (8 + 2) + 8}));
  const MaskTileClassesLayout layout = mask_tile_classes_layout(2, 8, 300, 500, 128, 64, MaskBlockLists::kKeyBlocks);
  EXPECT_EQ(layout.list_bytes, 2 * 8 * 3 * (8 + 2) * 4);
  EXPECT_EQ(layout.bytes, 2 * 8 * 3 * (4 * (8 + 2) + 8));
  std::vector<uint8_t> workspace(layout.bytes);  // split as the FFI handler splits it: lists first, classes after
  EXPECT_EQ(layout.block_lists(workspace.data()), reinterpret_cast<int32_t*>(workspace.data()));
  EXPECT_EQ(layout.tile_classes(workspace.data()), workspace.data() + layout.list_bytes);
  const MaskTileClassesLayout classes_only = mask_tile_classes_layout(2, 8, 300, 500, 128, 64);
  EXPECT_EQ(classes_only.block_lists(workspace.data()), nullptr);
  EXPECT_EQ(classes_only.tile_classes(workspace.data()), workspace.data());
  p.mask_mod = false;  // no mask mod: no lists asked, no workspace
  EXPECT_TRUE(plan_call(p, device(80, 0), table, archs).fwd.workspace.empty());
  EXPECT_FALSE(g_seen_query.mask_mod);
}

// A mask mod's tangent (issue 39) carries the tile classes of the tangent kernel's own tiles, with the block lists
// ahead of them where that kernel walks lists (the sm90 tangent); without a mask mod it has no workspace.
TEST_F(PlanCall, MaskModTangentsCarryTheirOwnTilesWorkspace) {
  table.push_back(entry(Direction::kTangent, DType::kBFloat16, 128));  // fake_bwd_choices' 64 x 128 tiles
  Problem p = problem();
  p.mask_mod = true;
  Plan plan = plan_call(p, device(80, 0), table, archs);
  ASSERT_NE(plan.tangent.kernel, nullptr) << plan.tangent.reason;
  ASSERT_EQ(plan.tangent.workspace.size(), 1u);
  EXPECT_STREQ(plan.tangent.workspace[0].name, "mask_tile_classes");
  EXPECT_STREQ(plan.tangent.workspace[0].dtype, "uint8");
  EXPECT_EQ(plan.tangent.workspace[0].shape, (std::vector<int64_t>{2, 8, 5, 4}));  // ceil(300/64), ceil(500/128)
  table.back().choices = fake_listing_fwd_choices;  // 128 x 64 tiles, block lists asked for mask mods
  plan = plan_call(p, device(80, 0), table, archs);
  ASSERT_EQ(plan.tangent.workspace.size(), 1u);
  EXPECT_EQ(plan.tangent.workspace[0].shape, (std::vector<int64_t>{2, 8, 3, 4 * (8 + 2) + 8}));
  p.mask_mod = false;
  EXPECT_TRUE(plan_call(p, device(80, 0), table, archs).tangent.workspace.empty());
}

// A backward that walks per-key-block lists of query blocks (the sm90 one): the lists int32 [B, Hq, n-blocks,
// m-blocks + 2] first, the classes after, in one uint8 buffer [B, Hq, bytes per (b, h)] (the lists do not come in
// rows per m-block), last after the f32 buffers; split as the FFI handler and the sanitizer driver split it.
FamilyChoices fake_listing_bwd_choices(const AttnShape& shape, const ChoiceQuery& query) {
  FamilyChoices c = fake_bwd_choices(shape, query);
  c.mask_block_lists = query.mask_mod ? MaskBlockLists::kQueryBlocks : MaskBlockLists::kNone;
  return c;
}

TEST_F(PlanCall, MaskModBackwardsThatWalkQueryBlockListsCarryThemAheadOfTheClasses) {
  for (KernelEntry& e : table) {
    if (e.direction == Direction::kBwd) e.choices = fake_listing_bwd_choices;
  }
  Problem p = problem();
  p.mask_mod = true;
  const Plan plan = plan_call(p, device(80, 0), table, archs);
  ASSERT_TRUE(plan.runs()) << plan.reason;
  ASSERT_EQ(plan.bwd.workspace.size(), 4u);
  EXPECT_STREQ(plan.bwd.workspace[3].name, "mask_tile_classes");
  EXPECT_STREQ(plan.bwd.workspace[3].dtype, "uint8");
  // 64 x 128 tiles: m-blocks ceil(300 / 64) = 5, n-blocks ceil(500 / 128) = 4.
  EXPECT_EQ(plan.bwd.workspace[3].shape, (std::vector<int64_t>{2, 8, 4 * 4 * (5 + 2) + 5 * 4}));
  const MaskTileClassesLayout layout = mask_tile_classes_layout(2, 8, 300, 500, 64, 128, MaskBlockLists::kQueryBlocks);
  EXPECT_EQ(layout.list_bytes, 2 * 8 * 4 * (5 + 2) * 4);
  EXPECT_EQ(layout.bytes, 2 * 8 * (4 * 4 * (5 + 2) + 5 * 4));
  std::vector<uint8_t> workspace(layout.bytes);
  EXPECT_EQ(layout.block_lists(workspace.data()), reinterpret_cast<int32_t*>(workspace.data()));
  EXPECT_EQ(layout.tile_classes(workspace.data()), workspace.data() + layout.list_bytes);
  // Sq = 0: no classes, but a (count 0) list per key block, which the kernel reads.
  const MaskTileClassesLayout no_rows = mask_tile_classes_layout(2, 8, 0, 500, 64, 128, MaskBlockLists::kQueryBlocks);
  EXPECT_EQ(no_rows.list_bytes, 2 * 8 * 4 * 2 * 4);
  EXPECT_EQ(no_rows.bytes, no_rows.list_bytes);
  EXPECT_NE(no_rows.block_lists(workspace.data()), nullptr);
  // The forward's passes keep their own layout (rows per m-block).
  EXPECT_EQ(plan.fwd.workspace[0].shape, (std::vector<int64_t>{2, 8, 3, 8}));
}

}  // namespace flashjax

// Host-side dispatch logic: which compiled code runs on which device, head-dim padding, kernel choice.
#include <gtest/gtest.h>

#include "ffi/dispatch.h"

namespace flashjax {
namespace {

// Rows as tools/gen_kernels.py marks them: varlen on the sm80 forward, backward and tangent and the sm90 forward and
// backward (not the sm90 tangent nor the sm90 fused jvp); mask mods on every sm80 row and the sm90 forward and
// tangent (not its backward, nor the fused jvp); varlen and mask mods together on the sm80 forward and backward only.
KernelEntry entry(const char* family, Direction d, DType t, int hdim, int smem_bytes = 48 * 1024) {
  const bool sm90 = std::string_view(family) == "sm90";
  const bool tangent = d == Direction::kTangent || d == Direction::kJvp;
  const bool varlen = !(sm90 && tangent);
  const bool mask_mod = d != Direction::kJvp;
  const bool varlen_mask_mod = !sm90 && !tangent;
  return {family, d,       t, hdim, /*arch_specific=*/sm90, smem_bytes, nullptr, nullptr, /*deterministic=*/false,
          varlen, mask_mod, varlen_mask_mod};
}

TEST(ArchRunsOn, SassRunsOnLaterMinorsOfTheSameMajor) {
  EXPECT_TRUE(arch_runs_on("80-real", 80));
  EXPECT_TRUE(arch_runs_on("80-real", 86));
  EXPECT_TRUE(arch_runs_on("80-real", 89));
  EXPECT_FALSE(arch_runs_on("80-real", 90));
  EXPECT_FALSE(arch_runs_on("86-real", 80));
  EXPECT_FALSE(arch_runs_on("80-real", 75));
}

TEST(ArchRunsOn, ArchSpecificOnlyOnItsOwnArch) {
  EXPECT_TRUE(arch_runs_on("90a-real", 90));
  EXPECT_TRUE(arch_runs_on("90a", 90));
  EXPECT_FALSE(arch_runs_on("90a-real", 100));
  EXPECT_FALSE(arch_runs_on("100a-real", 103));
}

TEST(ArchRunsOn, PtxRunsOnAnyLaterDevice) {
  EXPECT_TRUE(arch_runs_on("80-virtual", 120));
  EXPECT_TRUE(arch_runs_on("80", 100));
  EXPECT_FALSE(arch_runs_on("90-virtual", 89));
}

TEST(ArchRunsOn, RejectsMalformedSpellings) {
  EXPECT_FALSE(arch_runs_on("", 80));
  EXPECT_FALSE(arch_runs_on("sm80", 80));
  EXPECT_FALSE(arch_runs_on("80-fake", 80));
  EXPECT_FALSE(arch_runs_on("8x", 80));
}

TEST(SplitArchs, SplitsCMakeLists) {
  EXPECT_EQ(split_archs("80-real;90a-real"), (std::vector<std::string>{"80-real", "90a-real"}));
  EXPECT_EQ(split_archs(""), std::vector<std::string>{});
  EXPECT_EQ(split_archs(";80;;"), std::vector<std::string>{"80"});
  EXPECT_EQ(split_archs("80-real,120"), (std::vector<std::string>{"80-real", "120"}));
}

TEST(PaddedHeadDim, RoundsUpToTheNextCompiledWidth) {
  EXPECT_EQ(padded_head_dim(8), 64);
  EXPECT_EQ(padded_head_dim(64), 64);
  EXPECT_EQ(padded_head_dim(72), 96);
  EXPECT_EQ(padded_head_dim(136), 192);
  EXPECT_EQ(padded_head_dim(256), 256);
  EXPECT_EQ(padded_head_dim(264), 0);
}

TEST(MaxSmemPerBlockOptin, KnownArchs) {
  EXPECT_EQ(max_smem_per_block_optin(80), 166912);  // 163 KB
  EXPECT_EQ(max_smem_per_block_optin(86), 101376);  // 99 KB
  EXPECT_EQ(max_smem_per_block_optin(87), 166912);
  EXPECT_EQ(max_smem_per_block_optin(89), 101376);
  EXPECT_EQ(max_smem_per_block_optin(90), 232448);  // 227 KB
  EXPECT_EQ(max_smem_per_block_optin(100), 232448);
  EXPECT_EQ(max_smem_per_block_optin(120), 101376);
  EXPECT_EQ(max_smem_per_block_optin(75), 65536);
}

TEST(MaxSmemPerBlockOptin, UnknownArchsGetTheSmallestFigureOfTheirEra) {
  EXPECT_EQ(max_smem_per_block_optin(88), 101376);
  EXPECT_EQ(max_smem_per_block_optin(130), 101376);
  EXPECT_EQ(max_smem_per_block_optin(60), 49152);
  EXPECT_EQ(max_smem_per_block_optin(0), 49152);
}

class ChooseKernel : public ::testing::Test {
 protected:
  std::vector<KernelEntry> table = {
      entry("sm80", Direction::kFwd, DType::kBFloat16, 128),
      entry("sm80", Direction::kBwd, DType::kBFloat16, 128),
      entry("sm90", Direction::kFwd, DType::kBFloat16, 128),
      entry("sm80", Direction::kFwd, DType::kFloat16, 64),
  };
  std::vector<std::string> archs = {"80-real", "90a-real"};
  ProblemKey key(Direction d, DType t, int hdim) {
    ProblemKey k;
    k.direction = d;
    k.dtype = t;
    k.head_dim = hdim;
    return k;
  }
};

TEST_F(ChooseKernel, PrefersTheNewestFamilyTheDeviceRuns) {
  const Choice hopper = choose_kernel(90, archs, key(Direction::kFwd, DType::kBFloat16, 128), table);
  ASSERT_NE(hopper.kernel, nullptr);
  EXPECT_STREQ(hopper.kernel->family, "sm90");
  const Choice ampere = choose_kernel(86, archs, key(Direction::kFwd, DType::kBFloat16, 128), table);
  ASSERT_NE(ampere.kernel, nullptr);
  EXPECT_STREQ(ampere.kernel->family, "sm80");
  EXPECT_NE(ampere.reason.find("sm80 forward kernel"), std::string::npos) << ampere.reason;
}

// The sm90 backward has a row at every head dim (its 64-key plan at D 192 / 256 needs 209 KB, under sm90's 227 KB):
// Hopper takes it at each, other devices the sm80 row of the same width.
TEST_F(ChooseKernel, HopperTakesTheSm90BackwardAtEveryHeadDim) {
  std::vector<KernelEntry> rows;
  for (int hdim : {64, 96, 128, 192, 256}) {
    rows.push_back(entry("sm80", Direction::kBwd, DType::kBFloat16, hdim));
    rows.push_back(entry("sm90", Direction::kBwd, DType::kBFloat16, hdim, 209 * 1024));
  }
  for (int hdim : {64, 96, 128, 192, 256}) {
    const Choice hopper = choose_kernel(90, archs, key(Direction::kBwd, DType::kBFloat16, hdim), rows);
    ASSERT_NE(hopper.kernel, nullptr) << hdim;
    EXPECT_STREQ(hopper.kernel->family, "sm90") << hdim;
    EXPECT_EQ(hopper.kernel->head_dim, hdim);
    const Choice ampere = choose_kernel(80, archs, key(Direction::kBwd, DType::kBFloat16, hdim), rows);
    ASSERT_NE(ampere.kernel, nullptr) << hdim;
    EXPECT_STREQ(ampere.kernel->family, "sm80") << hdim;
  }
}

// The tangent (jax.jvp): the sm90 family's on Hopper for dense calls, the sm80 family's elsewhere and for varlen
// calls everywhere (the sm90 tangent row takes no packed sequences); explain says which.
TEST_F(ChooseKernel, TheTangentIsTheSm90FamilysOnHopperAndTheSm80FamilysElsewhere) {
  std::vector<KernelEntry> rows = table;
  rows.push_back(entry("sm80", Direction::kTangent, DType::kBFloat16, 128, 96 * 1024));
  rows.push_back(entry("sm90", Direction::kTangent, DType::kBFloat16, 128, 224 * 1024));
  for (const int sm : {80, 86, 89, 90}) {  // the devices this table's archs (80-real, 90a-real) run
    const Choice c = choose_kernel(sm, archs, key(Direction::kTangent, DType::kBFloat16, 128), rows,
                                   /*smem_per_block_optin=*/0, /*explain=*/true);
    ASSERT_NE(c.kernel, nullptr) << sm << ": " << c.reason;
    const char* family = sm == 90 ? "sm90" : "sm80";
    EXPECT_STREQ(c.kernel->family, family) << sm;
    EXPECT_EQ(c.kernel->direction, Direction::kTangent);
    EXPECT_NE(c.reason.find(std::string(family) + " tangent kernel, bf16, head dim 128"), std::string::npos)
        << c.reason;
    EXPECT_NE(c.reason.find("the newest family this sm_" + std::to_string(sm) + " device runs"), std::string::npos)
        << c.reason;
  }
  // A device whose per-block limit is below the sm90 row's takes the sm80 row, and explain names the reason.
  const Choice small = choose_kernel(90, archs, key(Direction::kTangent, DType::kBFloat16, 128), rows,
                                    /*smem_per_block_optin=*/200 * 1024, /*explain=*/true);
  ASSERT_NE(small.kernel, nullptr) << small.reason;
  EXPECT_STREQ(small.kernel->family, "sm80");
  EXPECT_NE(small.reason.find("the sm90 kernel needs 224 KB"), std::string::npos) << small.reason;
  ProblemKey varlen = key(Direction::kTangent, DType::kBFloat16, 128);
  varlen.varlen = true;
  const Choice packed = choose_kernel(90, archs, varlen, rows, /*smem_per_block_optin=*/0, /*explain=*/true);
  ASSERT_NE(packed.kernel, nullptr) << packed.reason;
  EXPECT_STREQ(packed.kernel->family, "sm80");
  EXPECT_NE(packed.reason.find("varlen"), std::string::npos) << packed.reason;
  const Choice missing = choose_kernel(90, archs, key(Direction::kTangent, DType::kFloat16, 128), rows);
  EXPECT_EQ(missing.kernel, nullptr);
  EXPECT_NE(missing.reason.find("no tangent kernel for fp16 head dim 128"), std::string::npos) << missing.reason;
}

TEST_F(ChooseKernel, MatchesDirectionDtypeAndHeadDim) {
  const Choice bwd = choose_kernel(90, archs, key(Direction::kBwd, DType::kBFloat16, 128), table);
  ASSERT_NE(bwd.kernel, nullptr);
  EXPECT_EQ(bwd.kernel->direction, Direction::kBwd);
  const Choice missing = choose_kernel(90, archs, key(Direction::kBwd, DType::kFloat16, 64), table);
  EXPECT_EQ(missing.kernel, nullptr);
  EXPECT_NE(missing.reason.find("no backward kernel for fp16 head dim 64"), std::string::npos) << missing.reason;
}

TEST_F(ChooseKernel, ArchSpecificFamiliesRunOnTheirArchOnly) {
  std::vector<std::string> with_blackwell = {"80-real", "90a-real", "100a-real"};
  const Choice blackwell = choose_kernel(100, with_blackwell, key(Direction::kFwd, DType::kBFloat16, 128), table);
  ASSERT_NE(blackwell.kernel, nullptr);
  EXPECT_STREQ(blackwell.kernel->family, "sm80");
}

TEST_F(ChooseKernel, RefusesDevicesWithoutCode) {
  const Choice blackwell = choose_kernel(100, archs, key(Direction::kFwd, DType::kBFloat16, 128), table);
  EXPECT_EQ(blackwell.kernel, nullptr);
  EXPECT_NE(blackwell.reason.find("no code for sm_100"), std::string::npos) << blackwell.reason;
  const Choice volta = choose_kernel(70, archs, key(Direction::kFwd, DType::kBFloat16, 128), table);
  EXPECT_EQ(volta.kernel, nullptr);
}

// Varlen runs on the rows that take packed sequences: on Hopper the sm90 forward and backward, elsewhere the sm80
// family both ways; a build whose sm90 backward row takes no varlen gives Hopper's varlen backward to the sm80 one.
// deterministic=True has no varlen kernel (the sm90 backward's dq counters are laid out per dense batch, the sm80
// backward's dq atomics land in any order), even where the sm90 row orders dense calls.
TEST_F(ChooseKernel, VarlenTakesTheRowsThatTakePackedSequences) {
  std::vector<KernelEntry> rows = table;
  rows.push_back(entry("sm90", Direction::kBwd, DType::kBFloat16, 128));
  std::vector<KernelEntry> dense_sm90_bwd = rows;
  dense_sm90_bwd.back().varlen = false;
  for (const Direction direction : {Direction::kFwd, Direction::kBwd}) {
    ProblemKey varlen = key(direction, DType::kBFloat16, 128);
    varlen.varlen = true;
    const Choice hopper = choose_kernel(90, archs, varlen, rows, /*smem_per_block_optin=*/0, /*explain=*/true);
    ASSERT_NE(hopper.kernel, nullptr);
    EXPECT_STREQ(hopper.kernel->family, "sm90");
    EXPECT_NE(hopper.reason.find("varlen"), std::string::npos) << hopper.reason;
    const Choice without = choose_kernel(90, archs, varlen, dense_sm90_bwd);
    ASSERT_NE(without.kernel, nullptr);
    EXPECT_STREQ(without.kernel->family, direction == Direction::kFwd ? "sm90" : "sm80");
    const Choice ampere = choose_kernel(86, archs, varlen, rows);
    ASSERT_NE(ampere.kernel, nullptr);
    EXPECT_STREQ(ampere.kernel->family, "sm80");
  }
  // A build whose only forward row takes no varlen refuses varlen forwards.
  std::vector<KernelEntry> dense_only = {entry("sm90", Direction::kFwd, DType::kBFloat16, 128)};
  dense_only[0].varlen = false;
  ProblemKey varlen = key(Direction::kFwd, DType::kBFloat16, 128);
  varlen.varlen = true;
  EXPECT_EQ(choose_kernel(90, archs, varlen, dense_only).kernel, nullptr);
  ProblemKey ordered = key(Direction::kBwd, DType::kBFloat16, 128);
  ordered.varlen = true;
  ordered.deterministic = true;
  for (KernelEntry& e : rows) e.deterministic = std::string_view(e.family) == "sm90";
  const Choice refused = choose_kernel(90, archs, ordered, rows);
  EXPECT_EQ(refused.kernel, nullptr);
  EXPECT_NE(refused.reason.find("deterministic=True"), std::string::npos) << refused.reason;
  ordered.varlen = false;  // the same row takes the dense call
  const Choice dense = choose_kernel(90, archs, ordered, rows);
  ASSERT_NE(dense.kernel, nullptr) << dense.reason;
  EXPECT_STREQ(dense.kernel->family, "sm90");
}

// Mask mods (issue 38) run on the rows marked mask_mod: the sm80 forward, backward and tangent on every device, the
// sm90 forward, backward and tangent on Hopper; varlen with a mask mod (sm80 only), the fused jvp and the deterministic
// backward (sm80 cannot order its dq sums, sm90's ordered adds count the band's steps, which the mask-mod lists skip)
// are refused with reasons.
TEST_F(ChooseKernel, MaskModsTakeTheNewestFamilyThatReadsTheBits) {
  std::vector<KernelEntry> rows = table;
  rows.push_back(entry("sm80", Direction::kTangent, DType::kBFloat16, 128));
  rows.push_back(entry("sm90", Direction::kTangent, DType::kBFloat16, 128));
  rows.push_back(entry("sm90", Direction::kBwd, DType::kBFloat16, 128));
  for (const Direction direction : {Direction::kFwd, Direction::kBwd, Direction::kTangent}) {
    for (const int sm : {80, 86, 90}) {
      ProblemKey mask = key(direction, DType::kBFloat16, 128);
      mask.mask_mod = true;
      const Choice c = choose_kernel(sm, archs, mask, rows, /*smem_per_block_optin=*/0, /*explain=*/true);
      ASSERT_NE(c.kernel, nullptr) << c.reason;
      EXPECT_STREQ(c.kernel->family, sm == 90 ? "sm90" : "sm80");
      EXPECT_EQ(c.kernel->direction, direction);
      EXPECT_NE(c.reason.find("the sm90 family's forward, backward and tangent walk per-tile block lists"),
                std::string::npos)
          << c.reason;
    }
  }
  // A row not marked is never chosen for a mask mod, however new its family.
  std::vector<KernelEntry> unmarked = table;
  for (KernelEntry& e : unmarked) e.mask_mod = std::string_view(e.family) == "sm80";
  ProblemKey forward_mask = key(Direction::kFwd, DType::kBFloat16, 128);
  forward_mask.mask_mod = true;
  const Choice sm80_only = choose_kernel(90, archs, forward_mask, unmarked);
  ASSERT_NE(sm80_only.kernel, nullptr) << sm80_only.reason;
  EXPECT_STREQ(sm80_only.kernel->family, "sm80");
  // A tangent row left out of the mask mods (the sm80 tangent's 16-key D 256 row: gen_kernels.py's
  // MASK_MOD_EXCLUDED) is never chosen for one; with no other row the call is refused.
  ProblemKey tangent = key(Direction::kTangent, DType::kBFloat16, 128);
  tangent.mask_mod = true;
  std::vector<KernelEntry> unmarked_tangent = table;
  unmarked_tangent.push_back(entry("sm80", Direction::kTangent, DType::kBFloat16, 128));
  unmarked_tangent.back().mask_mod = false;
  const Choice no_tangent = choose_kernel(90, archs, tangent, unmarked_tangent);
  EXPECT_EQ(no_tangent.kernel, nullptr);
  tangent.mask_mod = false;  // the same row takes the call without a mask mod
  ASSERT_NE(choose_kernel(90, archs, tangent, unmarked_tangent).kernel, nullptr);
  // Varlen with a mask mod: the rows that take the two together, sm80's forward and backward even on Hopper, where
  // the sm90 forward takes each alone (it is marked varlen and mask_mod); never the tangent.
  for (const Direction direction : {Direction::kFwd, Direction::kBwd}) {
    for (const int sm : {80, 90}) {
      ProblemKey packed = key(direction, DType::kBFloat16, 128);
      packed.mask_mod = packed.varlen = true;
      const Choice c = choose_kernel(sm, archs, packed, table, /*smem_per_block_optin=*/0, /*explain=*/true);
      ASSERT_NE(c.kernel, nullptr) << c.reason;
      EXPECT_STREQ(c.kernel->family, "sm80");
      EXPECT_NE(c.reason.find("varlen with a mask mod"), std::string::npos) << c.reason;
    }
  }
  std::vector<KernelEntry> no_combination = table;
  for (KernelEntry& e : no_combination) e.varlen_mask_mod = false;
  ProblemKey packed = key(Direction::kFwd, DType::kBFloat16, 128);
  packed.mask_mod = packed.varlen = true;
  EXPECT_EQ(choose_kernel(90, archs, packed, no_combination).kernel, nullptr);
  ProblemKey packed_tangent = key(Direction::kTangent, DType::kBFloat16, 128);
  packed_tangent.mask_mod = packed_tangent.varlen = true;
  std::vector<KernelEntry> every_tangent = rows;
  for (KernelEntry& e : every_tangent) e.mask_mod = e.varlen = e.varlen_mask_mod = true;
  const Choice no_varlen_tangent = choose_kernel(80, archs, packed_tangent, every_tangent);
  EXPECT_EQ(no_varlen_tangent.kernel, nullptr);
  EXPECT_NE(no_varlen_tangent.reason.find("mask_mod with varlen"), std::string::npos) << no_varlen_tangent.reason;
  ProblemKey ordered = key(Direction::kBwd, DType::kBFloat16, 128);
  ordered.mask_mod = ordered.deterministic = true;
  std::vector<KernelEntry> with_ordered = rows;  // the sm90 backward takes both flags, and them together
  for (KernelEntry& e : with_ordered) e.deterministic = std::string_view(e.family) == "sm90";
  const Choice mask_order = choose_kernel(90, archs, ordered, with_ordered);  // explains by default
  ASSERT_NE(mask_order.kernel, nullptr) << mask_order.reason;
  EXPECT_STREQ(mask_order.kernel->family, "sm90");
  EXPECT_NE(mask_order.reason.find("fixed order"), std::string::npos) << mask_order.reason;
  // Off Hopper only the sm80 backward takes mask mods, and it adds with atomics: refused, saying why.
  const Choice no_order = choose_kernel(80, archs, ordered, with_ordered);
  EXPECT_EQ(no_order.kernel, nullptr) << no_order.reason;
  EXPECT_NE(no_order.reason.find("deterministic=True"), std::string::npos) << no_order.reason;
  ordered.mask_mod = false;  // without the mod the same row orders them
  const Choice dense_order = choose_kernel(90, archs, ordered, with_ordered);
  ASSERT_NE(dense_order.kernel, nullptr) << dense_order.reason;
  EXPECT_STREQ(dense_order.kernel->family, "sm90");
}

// The kernels' figures when this was written (python -m flashjax lists the built ones): the sm80 backward needs
// 96 KB at head dim 64 and 160 KB at 128; the sm90 forward 209 KB at 128.
class ChooseKernelSharedMemory : public ChooseKernel {
 protected:
  std::vector<KernelEntry> table = {
      entry("sm80", Direction::kFwd, DType::kBFloat16, 128, 65536),
      entry("sm80", Direction::kBwd, DType::kBFloat16, 64, 98304),
      entry("sm80", Direction::kBwd, DType::kBFloat16, 128, 163840),
      entry("sm90", Direction::kFwd, DType::kBFloat16, 128, 214016),
      entry("sm80", Direction::kFwd, DType::kFloat16, 64, 48640),
  };
};

TEST_F(ChooseKernelSharedMemory, RefusesKernelsOverTheDeviceLimitWithTheReason) {
  for (int sm : {86, 89}) {
    const Choice c = choose_kernel(sm, archs, key(Direction::kBwd, DType::kBFloat16, 128), table);
    EXPECT_EQ(c.kernel, nullptr) << sm;
    EXPECT_EQ(c.reason, "the sm80 backward kernel for bf16 head dim 128 needs 160 KB of shared memory per block; sm_" +
                            std::to_string(sm) + " allows 99 KB");
  }
  std::vector<std::string> with_rtx = {"80-real", "90a-real", "120-real"};
  const Choice rtx = choose_kernel(120, with_rtx, key(Direction::kBwd, DType::kBFloat16, 128), table);
  EXPECT_EQ(rtx.kernel, nullptr);
  EXPECT_NE(rtx.reason.find("sm_120 allows 99 KB"), std::string::npos) << rtx.reason;
}

TEST_F(ChooseKernelSharedMemory, TakesKernelsThatFit) {
  const Choice bwd64 = choose_kernel(86, archs, key(Direction::kBwd, DType::kBFloat16, 64), table);  // 96 <= 99 KB
  ASSERT_NE(bwd64.kernel, nullptr);
  EXPECT_EQ(bwd64.kernel->smem_bytes, 98304);
  const Choice fwd128 = choose_kernel(86, archs, key(Direction::kFwd, DType::kBFloat16, 128), table);
  ASSERT_NE(fwd128.kernel, nullptr);
  EXPECT_STREQ(fwd128.kernel->family, "sm80");
  for (int sm : {80, 87, 90}) {
    const Choice c = choose_kernel(sm, archs, key(Direction::kBwd, DType::kBFloat16, 128), table);
    ASSERT_NE(c.kernel, nullptr) << sm << ": " << c.reason;
    EXPECT_EQ(c.kernel->smem_bytes, 163840);
  }
  const Choice hopper = choose_kernel(90, archs, key(Direction::kFwd, DType::kBFloat16, 128), table);
  ASSERT_NE(hopper.kernel, nullptr);
  EXPECT_STREQ(hopper.kernel->family, "sm90");
  EXPECT_EQ(hopper.reason.find("shared memory"), std::string::npos) << hopper.reason;
}

TEST_F(ChooseKernelSharedMemory, TheCallersLimitOverridesTheTable) {
  // The FFI handlers pass the device's cudaDevAttrMaxSharedMemoryPerBlockOptin; 0 means the table's figure.
  const ProblemKey bwd128 = key(Direction::kBwd, DType::kBFloat16, 128);
  EXPECT_NE(choose_kernel(80, archs, bwd128, table, 0).kernel, nullptr);
  EXPECT_EQ(choose_kernel(80, archs, bwd128, table, 101376).kernel, nullptr);
  EXPECT_NE(choose_kernel(86, archs, bwd128, table, 166912).kernel, nullptr);
  EXPECT_NE(choose_kernel(86, archs, bwd128, table, 163840).kernel, nullptr);  // exactly the need fits
  EXPECT_EQ(choose_kernel(86, archs, bwd128, table, 163839).kernel, nullptr);
}

TEST_F(ChooseKernelSharedMemory, FallsBackToAnOlderFamilyThatFitsAndSaysWhy) {
  const Choice c = choose_kernel(90, archs, key(Direction::kFwd, DType::kBFloat16, 128), table, 200 * 1024);
  ASSERT_NE(c.kernel, nullptr);
  EXPECT_STREQ(c.kernel->family, "sm80");
  EXPECT_NE(c.reason.find("the sm90 kernel needs 209 KB of shared memory per block, more than sm_90 allows (200 KB)"),
            std::string::npos)
      << c.reason;
}

TEST_F(ChooseKernelSharedMemory, ReportsFractionalKilobytes) {
  const Choice c = choose_kernel(86, archs, key(Direction::kFwd, DType::kFloat16, 64), table, 40 * 1024);
  EXPECT_EQ(c.kernel, nullptr);
  EXPECT_NE(c.reason.find("needs 47.5 KB of shared memory per block; sm_86 allows 40 KB"), std::string::npos)
      << c.reason;
}

// The fused jvp exists on Hopper only (sm90 rows at D <= 128): elsewhere, for varlen and for mask mods dispatch finds
// none and explains why, and the caller runs the forward + tangent pair.
TEST(FusedJvpDispatch, OnlyOnHopperDenseCalls) {
  const std::vector<std::string> archs = {"80-real", "90a-real"};
  const std::vector<KernelEntry> rows = {entry("sm80", Direction::kTangent, DType::kBFloat16, 128),
                                         entry("sm90", Direction::kJvp, DType::kBFloat16, 128, 192 * 1024)};
  ProblemKey key;
  key.direction = Direction::kJvp;
  key.dtype = DType::kBFloat16;
  key.head_dim = 128;
  const Choice hopper = choose_kernel(90, archs, key, rows);
  ASSERT_NE(hopper.kernel, nullptr) << hopper.reason;
  EXPECT_EQ(hopper.kernel->direction, Direction::kJvp);
  EXPECT_NE(hopper.reason.find("sm90 fused jvp kernel"), std::string::npos) << hopper.reason;
  const Choice ampere = choose_kernel(80, archs, key, rows);
  EXPECT_EQ(ampere.kernel, nullptr);
  EXPECT_NE(ampere.reason.find("no fused jvp kernel"), std::string::npos) << ampere.reason;
  key.head_dim = 256;
  EXPECT_EQ(choose_kernel(90, archs, key, rows).kernel, nullptr);
  key.head_dim = 128;
  key.varlen = true;
  EXPECT_EQ(choose_kernel(90, archs, key, rows).kernel, nullptr);
  key.varlen = false;
  key.mask_mod = true;
  EXPECT_EQ(choose_kernel(90, archs, key, rows).kernel, nullptr);
}

}  // namespace
}  // namespace flashjax

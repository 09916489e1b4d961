// Host-side dispatch logic: which compiled code runs on which device, head-dim padding, kernel choice.
#include <gtest/gtest.h>

#include "ffi/dispatch.h"

namespace flashjax {
namespace {

KernelEntry entry(const char* family, Direction d, DType t, int hdim) {
  return {family, d, t, hdim, /*arch_specific=*/std::string_view(family) == "sm90", nullptr};
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

TEST_F(ChooseKernel, RefusesFeaturesWithoutKernels) {
  ProblemKey varlen = key(Direction::kFwd, DType::kBFloat16, 128);
  varlen.varlen = true;
  EXPECT_EQ(choose_kernel(90, archs, varlen, table).kernel, nullptr);
  ProblemKey mask = key(Direction::kFwd, DType::kBFloat16, 128);
  mask.mask_mod = true;
  const Choice c = choose_kernel(90, archs, mask, table);
  EXPECT_EQ(c.kernel, nullptr);
  EXPECT_NE(c.reason.find("mask_mod"), std::string::npos);
}

}  // namespace
}  // namespace flashjax

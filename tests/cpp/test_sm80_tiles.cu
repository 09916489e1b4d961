// The portable (sm80) family's rows as the full kernel set has them, with the kernels' own shared-memory figures
// and tile choices (the generated table's rows, their <direction>_smem_bytes and <direction>_choices instantiated
// here on the host; no kernel is compiled): every head dim has a row that fits the 99 KB parts, no 99 KB row repeats
// its 163 KB row, and dispatch gives each GPU of the release build's architectures the largest tiles it holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ffi/dispatch.h"
#include "kernels/sm80/bwd_launch.cuh"
#include "kernels/sm80/fwd_launch.cuh"
#include "kernels/sm80/tangent_launch.cuh"

namespace flashjax {
namespace {

constexpr int kKB = 1024;
constexpr int kHeadDims[] = {64, 96, 128, 192, 256};
constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16};
constexpr Direction kDirections[] = {Direction::kFwd, Direction::kBwd, Direction::kTangent};

// The full set's sm80 rows (the sm90 ones are behind FLASHJAX_HAS_SM90, which this file leaves undefined).
const std::vector<KernelEntry>& sm80_rows() {
#define FLASHJAX_KERNEL(family, run, direction, params, dtype, targs, hdim, arch_specific, smem_bytes, choices, \
                        deterministic, varlen, mask_mod, varlen_mask_mod)                                   \
  FLASHJAX_KERNEL_ENTRY(family, direction, dtype, targs, hdim, arch_specific, smem_bytes, choices, deterministic, \
                        varlen, mask_mod, varlen_mask_mod, nullptr)
  static const std::vector<KernelEntry> rows = {
#include "kernels/generated/kernel_table_full.inc"
  };
#undef FLASHJAX_KERNEL
  return rows;
}

std::vector<const KernelEntry*> rows_of(Direction direction, DType dtype, int head_dim) {
  std::vector<const KernelEntry*> out;
  for (const KernelEntry& e : sm80_rows()) {
    if (e.direction == direction && e.dtype == dtype && e.head_dim == head_dim) out.push_back(&e);
  }
  return out;
}

std::string what(Direction direction, DType dtype, int head_dim) {
  const char* name = direction == Direction::kFwd ? "fwd" : direction == Direction::kBwd ? "bwd" : "tangent";
  return std::string(name) + (dtype == DType::kFloat16 ? " fp16" : " bf16") +
         " D " + std::to_string(head_dim);
}

FamilyChoices choices_of(const KernelEntry& e) {
  AttnShape shape;
  shape.batch = 1;
  shape.seqlen_q = shape.seqlen_k = 1024;
  shape.heads_q = shape.heads_k = 1;
  shape.head_dim = e.head_dim;
  shape.dtype = e.dtype;
  return e.choices(shape, ChoiceQuery{});
}

TEST(Sm80Tiles, EveryHeadDimHasARowForSm80AndOneForThe99KbParts) {
  for (const Direction d : kDirections) {
    for (const DType t : kDtypes) {
      for (const int hdim : kHeadDims) {
        const std::vector<const KernelEntry*> rows = rows_of(d, t, hdim);
        ASSERT_FALSE(rows.empty()) << what(d, t, hdim);
        int least = rows[0]->smem_bytes, most = rows[0]->smem_bytes;
        for (const KernelEntry* e : rows) {
          least = std::min(least, e->smem_bytes);
          most = std::max(most, e->smem_bytes);
        }
        EXPECT_LE(least, 99 * kKB) << what(d, t, hdim);
        EXPECT_LE(most, 163 * kKB) << what(d, t, hdim);
      }
    }
  }
}

TEST(Sm80Tiles, A99KbRowExistsOnlyWhereThe163KbTilesDoNotFit) {
  // Two rows of one width differ in their tiles and figures, and the second exists because the first needs more
  // than 99 KB (tools/gen_kernels.py's SMEM_BUDGETS lists the widths; this keeps the list honest).
  for (const Direction d : kDirections) {
    for (const DType t : kDtypes) {
      for (const int hdim : kHeadDims) {
        const std::vector<const KernelEntry*> rows = rows_of(d, t, hdim);
        ASSERT_LE(rows.size(), 2u) << what(d, t, hdim);
        if (rows.size() == 1) {
          EXPECT_LE(rows[0]->smem_bytes, 99 * kKB) << what(d, t, hdim) << ": needs a 99 KB row";
          continue;
        }
        const KernelEntry* large = rows[0]->smem_bytes > rows[1]->smem_bytes ? rows[0] : rows[1];
        const KernelEntry* small = large == rows[0] ? rows[1] : rows[0];
        EXPECT_GT(large->smem_bytes, 99 * kKB) << what(d, t, hdim) << ": the 99 KB row repeats the 163 KB one";
        EXPECT_LE(small->smem_bytes, 99 * kKB) << what(d, t, hdim);
        const FamilyChoices a = choices_of(*large), b = choices_of(*small);
        EXPECT_TRUE(a.block_m != b.block_m || a.block_n != b.block_n || large->smem_bytes != small->smem_bytes)
            << what(d, t, hdim);
      }
    }
  }
}

TEST(Sm80Tiles, TheFiguresAreTheTileFunctionsOwn) {
  // What the comments of fwd_tile_sizes.cuh / bwd_tile_sizes.cuh / tangent_tile_sizes.cuh say, row by row.
  struct Expect {
    Direction d;
    int hdim, kb, block_m, block_n;
  };
  const Expect expected[] = {
      {Direction::kFwd, 64, 32, 128, 64},  {Direction::kFwd, 128, 64, 128, 64}, {Direction::kFwd, 192, 96, 128, 64},
      {Direction::kFwd, 256, 128, 128, 64}, {Direction::kFwd, 256, 96, 64, 64},
      {Direction::kBwd, 64, 96, 64, 128},  {Direction::kBwd, 96, 128, 64, 128}, {Direction::kBwd, 96, 88, 64, 64},
      {Direction::kBwd, 128, 160, 64, 128}, {Direction::kBwd, 128, 96, 64, 64}, {Direction::kBwd, 192, 160, 64, 64},
      {Direction::kBwd, 192, 92, 32, 64},  {Direction::kBwd, 256, 144, 64, 64}, {Direction::kBwd, 256, 96, 64, 32},
      // tangent_tile_sizes.cuh
      {Direction::kTangent, 64, 48, 64, 64},  {Direction::kTangent, 96, 72, 64, 64},
      {Direction::kTangent, 128, 96, 64, 64}, {Direction::kTangent, 192, 96, 64, 32},
      {Direction::kTangent, 256, 128, 64, 32},
      {Direction::kTangent, 256, 96, 64, 16},
  };
  for (const Expect& x : expected) {
    bool found = false;
    for (const KernelEntry* e : rows_of(x.d, DType::kBFloat16, x.hdim)) {
      if (e->smem_bytes != x.kb * kKB) continue;
      found = true;
      const FamilyChoices c = choices_of(*e);
      EXPECT_EQ(c.block_m, x.block_m) << what(x.d, DType::kBFloat16, x.hdim) << " " << x.kb << " KB";
      EXPECT_EQ(c.block_n, x.block_n) << what(x.d, DType::kBFloat16, x.hdim) << " " << x.kb << " KB";
    }
    EXPECT_TRUE(found) << what(x.d, DType::kBFloat16, x.hdim) << ": no " << x.kb << " KB row";
  }
}

// The GPUs the release wheels are for, with the shared memory per block dispatch assumes on each.
constexpr int kReleaseGpus[] = {80, 86, 87, 89, 90, 100, 103, 120, 121};

TEST(Sm80Tiles, TheReleaseArchitecturesHaveCodeForEveryGpu) {
  const std::vector<std::string> archs = split_archs(FLASHJAX_RELEASE_ARCHS);
  for (const int sm : kReleaseGpus) {
    bool any = false, real = false;
    for (const std::string& arch : archs) {
      const bool runs = arch_runs_on(arch, sm);
      any |= runs;
      real |= runs && arch.find("-real") != std::string::npos;
    }
    EXPECT_TRUE(any) << "sm_" << sm << " runs nothing of " << FLASHJAX_RELEASE_ARCHS;
    // With CUDA 12.8 or newer (sm100 and sm120 machine code), every one of them runs machine code, not JIT'ed PTX.
#if CUDART_VERSION >= 12080
    EXPECT_TRUE(real) << "sm_" << sm << " has no machine code in " << FLASHJAX_RELEASE_ARCHS;
#endif
  }
}

TEST(Sm80Tiles, DispatchGivesEachReleaseGpuTheLargestTilesItHolds) {
  const std::vector<std::string> archs = split_archs(FLASHJAX_RELEASE_ARCHS);
  for (const int sm : kReleaseGpus) {
    const int limit = max_smem_per_block_optin(sm);
    for (const Direction d : kDirections) {
      for (const DType t : kDtypes) {
        for (const int hdim : kHeadDims) {
          ProblemKey key;
          key.direction = d;
          key.dtype = t;
          key.head_dim = hdim;
          const Choice c = choose_kernel(sm, archs, key, sm80_rows(), 0, true);
          ASSERT_NE(c.kernel, nullptr) << "sm_" << sm << " " << what(d, t, hdim) << ": " << c.reason;
          EXPECT_LE(c.kernel->smem_bytes, limit) << "sm_" << sm << " " << what(d, t, hdim);
          for (const KernelEntry* e : rows_of(d, t, hdim)) {
            if (e->smem_bytes > limit) continue;
            EXPECT_GE(c.kernel->smem_bytes, e->smem_bytes) << "sm_" << sm << " " << what(d, t, hdim);
          }
        }
      }
    }
  }
  // Blackwell: sm100 (227 KB) takes the 163 KB tiles, sm120 (99 KB) the small ones; their reasons say so.
  ProblemKey bwd256;
  bwd256.direction = Direction::kBwd;
  bwd256.head_dim = 256;
  const Choice b200 = choose_kernel(100, archs, bwd256, sm80_rows());
  ASSERT_NE(b200.kernel, nullptr) << b200.reason;
  EXPECT_EQ(b200.kernel->smem_bytes, 144 * kKB);
  const Choice rtx5090 = choose_kernel(120, archs, bwd256, sm80_rows());
  ASSERT_NE(rtx5090.kernel, nullptr) << rtx5090.reason;
  EXPECT_EQ(rtx5090.kernel->smem_bytes, 96 * kKB);
  EXPECT_NE(rtx5090.reason.find("its smaller tiles (96 KB of shared memory per block): the larger ones need 144 KB, "
                                "sm_120 allows 99 KB"),
            std::string::npos)
      << rtx5090.reason;
  EXPECT_EQ(b200.reason.find("smaller tiles"), std::string::npos) << b200.reason;
}

TEST(Sm80Tiles, ACappedLimitTakesTheSmallTilesOnAnyGpu) {
  // FLASHJAX_SMEM_LIMIT_KB=99 makes the callers pass 99 KB (dispatch_smem_limit): an H200 then runs the RTX rows.
  const std::vector<std::string> archs = {"80-real", "90a-real"};
  for (const int hdim : kHeadDims) {
    ProblemKey key;
    key.direction = Direction::kBwd;
    key.head_dim = hdim;
    const Choice capped = choose_kernel(90, archs, key, sm80_rows(), 99 * kKB);
    const Choice rtx = choose_kernel(89, archs, key, sm80_rows());
    ASSERT_NE(capped.kernel, nullptr) << hdim << ": " << capped.reason;
    EXPECT_EQ(capped.kernel, rtx.kernel) << hdim;
  }
}

}  // namespace
}  // namespace flashjax

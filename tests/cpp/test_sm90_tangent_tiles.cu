// The sm90 tangent kernel's tiles (csrc/kernels/sm90/tangent_tile_sizes.cuh) and the shared memory its storage takes,
// with the numbers of the header's comment, docs/design.md §3.7 and the README's table: every width fits the sm90
// per-block limit, and the register rule (t_out accumulator + S, tS + P, W per consumer thread) stays under 240.
#include <gtest/gtest.h>

#include <cutlass/numeric_types.h>

#include "kernels/sm90/tangent_kernel.cuh"

namespace flashjax::sm90 {
namespace {

struct Row {
  int head_dim, block_n, stages_k, stages_v, smem_bytes;
};
// smem_bytes: sizeof the kernel's SharedStorage, as tools/check_compile.sh sm90 tangent prints it.
constexpr Row kRows[] = {{64, 64, 3, 3, 132096},
                         {96, 64, 3, 3, 197632},
                         {128, 64, 3, 2, 230400},
                         {192, 32, 3, 2, 222208},
                         {256, 32, 2, 1, 230400}};

template <int kHeadDim>
int kernel_smem_bytes() {
  using Uncapped = TangentKernelSm90<cutlass::bfloat16_t, kHeadDim, false>;
  using Capped = TangentKernelSm90<cutlass::half_t, kHeadDim, true>;
  static_assert(Uncapped::kSmemBytes == Capped::kSmemBytes, "dtype and softcap do not change the storage");
  return Uncapped::kSmemBytes;
}

TEST(Sm90TangentTiles, MatchTheDocumentedTable) {
  const int smem[] = {kernel_smem_bytes<64>(), kernel_smem_bytes<96>(), kernel_smem_bytes<128>(),
                      kernel_smem_bytes<192>(), kernel_smem_bytes<256>()};
  int i = 0;
  for (const Row& row : kRows) {
    const TangentTileSizes tile = tangent_tile_sizes(row.head_dim);
    EXPECT_EQ(tile.block_m, 128) << row.head_dim;
    EXPECT_EQ(tile.block_n, row.block_n) << row.head_dim;
    EXPECT_EQ(tile.stages_k, row.stages_k) << row.head_dim;
    EXPECT_EQ(tile.stages_v, row.stages_v) << row.head_dim;
    EXPECT_GE(tile.stages_k, tile.stages_v) << row.head_dim;
    EXPECT_EQ(smem[i], row.smem_bytes) << row.head_dim;
    EXPECT_LE(smem[i], 227 * 1024) << row.head_dim;  // the sm90 per-block opt-in limit
    EXPECT_GE(smem[i], tangent_tile_smem_bytes(tile, row.head_dim)) << row.head_dim;
    // Per consumer thread: D / 2 accumulator values, block_n / 2 each for S and tS, block_n / 4 each for P and W.
    EXPECT_LE(row.head_dim / 2 + 3 * row.block_n / 2, 176) << row.head_dim;
    ++i;
  }
}

}  // namespace
}  // namespace flashjax::sm90

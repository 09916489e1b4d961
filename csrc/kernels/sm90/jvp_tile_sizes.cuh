// Tile sizes of the sm90 fused jvp kernel (primal and tangent in one pass, jvp_kernel.cuh): one pure function of the
// head dim. A CTA is 128 query rows (two consumer warpgroups of 64, each its own wgmma M) plus a producer warpgroup,
// as the tangent's (tangent_tile_sizes.cuh); the shared memory is laid out by the tangent's mainloop types.
#pragma once

#include "kernels/sm90/tangent_tile_sizes.cuh"

namespace flashjax::sm90 {

// The widest head dim the fused kernel compiles; wider calls keep the forward + tangent pair (gen_kernels.py).
constexpr int kJvpMaxHeadDim = 128;

// Registers bound the tile. A consumer thread holds two f32 accumulators, O and its tangent tO (64 x D / 128 = D / 2
// values each), the f32 scores S and tS (block_n / 2 each), and P and W = P * tS as 16-bit operands (block_n / 4
// each) live while the previous block's PV GEMMs run, all under setmaxnreg's 240:
//   D 64:      64 keys: 32 + 32 + 64 + 32 = 160 values;
//   D 96, 128: 32 keys: 48 / 64 + 48 / 64 + 32 + 16 = 144 / 176  (64 keys would need 192 / 224: spills at D 128);
//   D 192, 256 would need 192 / 256 for O and tO alone: those head dims stay on forward + tangent.
// Stages: the tangent's rule (tangent_tile_with_stages) with a deeper cap, 8, since 32-key stages are half as large
// and a step consumes them twice as fast: D 64: 4 + 4 (160 KB), D 96: 4 + 4 (144 KB), D 128: 4 + 4 (192 KB).
constexpr TangentTileSizes jvp_tile_sizes(int head_dim) {
  return tangent_tile_with_stages(head_dim <= 64 ? 64 : 32, head_dim, /*max_stages=*/8);
}

}  // namespace flashjax::sm90

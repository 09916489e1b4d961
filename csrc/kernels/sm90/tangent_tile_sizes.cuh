// Tile sizes of the sm90 tangent kernel (forward-mode derivative, tangent_kernel.cuh): one pure function of the head
// dim. A CTA is 128 query rows (two consumer warpgroups of 64, each its own wgmma M) plus a producer warpgroup.
#pragma once

namespace flashjax::sm90 {

struct TangentTileSizes {
  int block_m;   // query rows per CTA: 64 per consumer warpgroup
  int block_n;   // keys per step
  int stages_k;  // depth of the (K, tK) ring
  int stages_v;  // depth of the (V, tV) ring
};

// Shared memory of a configuration in bytes (2-byte elements): Q and tQ (block_m x D each) and per stage a K and a
// tK tile, or a V and a tV tile (block_n x D each). TangentKernelSm90 static_asserts that its storage (this, the
// alignment padding and the barriers) fits the 227 KB opt-in.
constexpr int tangent_tile_smem_bytes(const TangentTileSizes& t, int head_dim) {
  return 2 * head_dim * (2 * t.block_m + 2 * t.block_n * (t.stages_k + t.stages_v));
}

// The stage rule the tangent and the fused jvp (jvp_tile_sizes.cuh) share: from one stage each, add a stage to the
// shallower ring (K's first: the score GEMMs wait on K first) while the tiles fit 227 KB less 1 KB (barriers,
// alignment) and the rings hold at most max_stages together.
constexpr TangentTileSizes tangent_tile_with_stages(int block_n, int head_dim, int max_stages) {
  constexpr int kBudget = 226 * 1024;
  TangentTileSizes tile{128, block_n, 1, 1};
  while (tile.stages_k + tile.stages_v < max_stages) {
    TangentTileSizes more = tile;
    if (more.stages_k <= more.stages_v) {
      ++more.stages_k;
    } else {
      ++more.stages_v;
    }
    if (tangent_tile_smem_bytes(more, head_dim) > kBudget) break;
    tile = more;
  }
  return tile;
}

// Registers bound the tile, shared memory the stages. A consumer thread holds the f32 output tangent (64 x D / 128
// = D / 2 values), the f32 scores S and tS (block_n / 2 each) and their 16-bit forms P and W (block_n / 4 each),
// under the 240 registers setmaxnreg gives it:
//   D <= 128: 64 keys:  D / 2 + 96 = 128 .. 160 values;  128 keys would need 224 at D 64 (no room for addresses);
//   D 192, 256: 32 keys: 96 / 128 + 48 = 144 / 176;      64 keys would need 192 / 224.
// Stages: tangent_tile_with_stages, six at most (D 64 would fit more; not measured). Tiles: D 64: 3 + 3 (128 KB),
// D 96: 3 + 3 (192 KB), D 128: 3 + 2 (224 KB), D 192: 3 + 2 (216 KB), D 256: 2 + 1 (224 KB); the kernels' dynamic
// shared memory with alignment and barriers (tools/check_compile.sh sm90 tangent): 129, 193, 225, 217 and 225 KB.
constexpr TangentTileSizes tangent_tile_sizes(int head_dim) {
  return tangent_tile_with_stages(head_dim <= 128 ? 64 : 32, head_dim, /*max_stages=*/6);
}

}  // namespace flashjax::sm90

// Tile sizes of the sm90 forward kernel: one pure function of the head dim and of whether the call has a band
// (causal or a window). Where the two answers differ, the instantiation holds both kernels and picks at launch.
//
// Every tile has kBlockM = 128 query rows: two consumer warpgroups of 64 rows each (one wgmma M atom), which is
// what the inter-warpgroup ping-pong needs. kBlockN (keys per mainloop step) is bounded by
//   shared memory: Q (128 x D) + 2 stages of K and of V (kBlockN x D each), 2 bytes per element, <= 227 KB;
//   registers:     per consumer thread S (64 x kBlockN / 128 fp32) + P (half of S, 16-bit) + O (64 x D / 128 fp32)
//                  under the 240 that setmaxnreg grants, with S of the next block live next to P (overlap);
//   the wgmma shapes: kBlockN is the N of S = Q K^T (a multiple of 8) and the K of O += P V (a multiple of 16).
// fp16 and bf16 share sizes and wgmma shapes, so the element type does not change the choice.
#pragma once

namespace flashjax::sm90 {

struct FwdTileSizes {
  int block_m;
  int block_n;
};

constexpr FwdTileSizes fwd_tile_sizes(int head_dim, bool banded) {
  // D = 64 / 96: smem is small (80 / 112 KB), so kBlockN = 128 is bounded by the exp2 work per row that the
  // ping-pong has to hide; S 64 + P 32 + O 32 / 48 registers.
  if (head_dim <= 96) return {128, 128};
  // D = 128 (FA3's choices): without a band, 176 keys per step (Q 32 + K 88 + V 88 = 208 KB; S 88 + P 44 + O 64
  // registers) amortize the per-step softmax and barrier costs over more keys; with a band, the diagonal blocks
  // are partly masked and 128 wastes less of them (160 KB; S 64 + P 32 + O 64).
  if (head_dim <= 128) return {128, banded ? 128 : 176};
  // D = 192: Q 48 + K 84 + V 84 = 216 KB, the largest multiple of 16 that fits; S 56 + P 28 + O 96 registers.
  if (head_dim <= 192) return {128, 112};
  // D = 256: Q 64 + K 80 + V 80 = 224 KB, the smem limit (FA3's choice); S 40 + P 20 + O 128 registers.
  return {128, 80};
}

}  // namespace flashjax::sm90

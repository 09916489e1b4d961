// Tile sizes of the sm90 forward kernel: one pure function of the head dim and of how many keys the call's query rows
// see (FwdKeyLoad, classified per call by fwd_choices.cuh's key_load). Where the answers differ, the instantiation
// holds each distinct kernel and picks at launch.
//
// kBlockM is 64 query rows (one wgmma M atom) per consumer warpgroup, two or three of them taking turns on the
// tensor cores (ping-pong). kBlockN (keys per mainloop step) is bounded by
//   shared memory: Q (128 x D) + 2 stages of K and of V (kBlockN x D each), 2 bytes per element, <= 227 KB
//                  (plus O's staging buffer and a second Q buffer where they fit: FwdKernelSm90);
//   registers:     per consumer thread S (64 x kBlockN / 128 fp32) + P (half of S, 16-bit) + O (64 x D / 128 fp32)
//                  under the 240 (two consumer warpgroups) or 160 (three) that setmaxnreg grants, with S of the
//                  next block live next to P (overlap);
//   the wgmma shapes: kBlockN is the N of S = Q K^T (a multiple of 8) and the K of O += P V (a multiple of 16).
// fp16 and bf16 share sizes and wgmma shapes, so the element type does not change the choice.
#pragma once

namespace flashjax::sm90 {

struct FwdTileSizes {
  int block_m;
  int block_n;
};

// kFewShortBand calls are kFew calls; kManyShortRows calls are kMany calls.
enum class FwdKeyLoad {
  kFewShortBand,   // more than one 128-row tile and a band whose middle row sees < 512 keys
  kFew,            // at most one 128-row tile of queries, or a band whose middle row sees < 2048 keys
  kManyShortRows,  // more than one 128-row tile, no band, at most 512 keys
  kMany,           // the rest
};

constexpr FwdTileSizes fwd_tile_sizes(int head_dim, FwdKeyLoad load) {
  const bool many_keys = load == FwdKeyLoad::kMany || load == FwdKeyLoad::kManyShortRows;
  // D = 64: the exp2 work per key is as large as the GEMM work (64 x 128 exponentials per warpgroup and block
  // take the SFU as long as the block's two GEMMs take the tensor cores), so a third consumer warpgroup (FA3's
  // 192 x 128; S 64 + P 32 + O 32 registers under 160) keeps the tensor cores fed while two others exponentiate:
  // +7-11% over 128 x 128 on every non-causal row and +4-6% on causal rows from S = 4k. With few keys per row
  // the 192-row tile loses (masking: a 192-row tile straddles 2-3 blocks of a causal diagonal, a 128-row one 1;
  // and a longer fill and drain per tile): -20-30% on causal S = 512-2k (measured on the H200: docs/performance.md).
  if (head_dim <= 64) return many_keys ? FwdTileSizes{192, 128} : FwdTileSizes{128, 128};
  // D = 96: smem is small (112 KB); S 64 + P 32 + O 48 registers. (Three warpgroups would leave 160 registers for
  // 144 of fragments: not tried.)
  if (head_dim <= 96) return {128, 128};
  // D = 128: 128 keys per step (160 KB; S 64 + P 32 + O 64 registers) leaves room for a second Q buffer, so that
  // the next tile's Q is loaded and its first GEMM issued while this tile drains (docs/performance.md), and for a
  // third K stage (O is then staged in the Q buffer: FwdKernelSm90's buffer plans). FA3's 176 keys per step on rows
  // of >= 8192 keys without a band (one Q buffer, two K stages) won 2-4% there until softcap became a compile-time
  // choice; since then 128 x 128 is as fast or faster on those rows too (docs/performance.md, lever table).
  if (head_dim <= 128) return {128, 128};
  // D = 192: Q 48 + K 84 + V 84 = 216 KB, the largest multiple of 16 that fits; S 56 + P 28 + O 96 registers.
  // Where the band is short, 64 keys per step leave room for a second Q buffer and a third K stage (2 x 48 + 3 x 24
  // + 2 x 24 = 216 KB), so tiles carry over as at D = 128 (see D = 256 below): causal S 512 258 -> 314 TFLOP/s
  // (0.98 -> 1.22 of cuDNN; docs/performance.md).
  // Rows of at most 512 keys take 64 keys per step too: 112 would pad 512 keys to 560 (9% of the work on keys past
  // the end).
  if (head_dim <= 192) {
    const bool short_rows = load == FwdKeyLoad::kFewShortBand || load == FwdKeyLoad::kManyShortRows;
    return short_rows ? FwdTileSizes{128, 64} : FwdTileSizes{128, 112};
  }
  // D = 256: Q 64 + K 80 + V 80 = 224 KB, the smem limit (FA3's choice); S 40 + P 20 + O 128 registers. That
  // leaves one Q buffer, with O staged in it, so each tile's Q loads only after the previous tile's epilogue and the
  // consumers wait for it. Where tiles are a few blocks long (causal S 512: 2-7 blocks) that wait is a large part of
  // the tile: 48 keys per step (K 48 + V 48) makes room for O's own buffer, and Q's buffer frees once the tile's last
  // Q K^T is done: +4-7% at causal S 512, but -2% at S 1k and -5% at S 2k, where the smaller steps cost more than the
  // wait (docs/performance.md).
  // Rows of at most 512 keys without a band: 80 keys per step pad 512 keys to 560 (9% of the work on keys past the
  // end), 64 divide them: S 512 444 -> 480 TFLOP/s (1.07 -> 1.16 of cuDNN; 48 keys: 460; docs/performance.md).
  if (load == FwdKeyLoad::kManyShortRows) return {128, 64};
  return load == FwdKeyLoad::kFewShortBand ? FwdTileSizes{128, 48} : FwdTileSizes{128, 80};
}

}  // namespace flashjax::sm90

// Tile sizes of the sm90 backward kernel: one pure function of the head dim.
//
// A CTA owns kBlockN = 128 keys of one KV head (two MMA warpgroups of 64 keys each: the M of a wgmma) and walks the
// query blocks of kBlockM rows that see them, for every query head of the GQA group. Per MMA thread (128 per
// warpgroup, setmaxnreg 240) the registers hold, for the whole sweep, dK and dV of the warpgroup's 64 keys
// (2 * 64 * D / 128 f32), and per step S^T and dP^T (2 * 64 * kBlockM / 128 f32) and this warpgroup's share of
// dQ (kBlockM * D / 256 f32). Shared memory holds K, V (kBlockN x D each), two stages of Q and of dO
// (kBlockM x D), dS (kBlockM x kBlockN, 16-bit) and the dQ staging buffer (kBlockM x D, f32), all under 227 KB.
// fp16 and bf16 have the same size and wgmma shapes, so the element type does not change the choice.
#pragma once

namespace flashjax::sm90 {

struct BwdTileSizes {
  int block_m;  // query rows per step (Q / dO tile); also the N of S^T = K Q^T and the K of dK / dV
  int block_n;  // keys per CTA
};

constexpr BwdTileSizes bwd_tile_sizes(int head_dim) {
  // D = 64 and D = 128: 64-row steps. At D = 128 dK + dV take 128 registers, S^T + dP^T 64, dQ 32: 224 of 240
  // (177 KB). At D = 64, FlashAttention-3's 128-row steps (S^T + dP^T 128, dK + dV 64, dQ 32, P^T and dS^T 64 more
  // while the dK / dV GEMMs read them) spilled 904 bytes here (each thread also reads the LSE and D' of its 32
  // query columns); 64-row steps compile without spills (98 KB).
  return {64, 128};
}

}  // namespace flashjax::sm90

// Tile sizes and warpgroup split of the sm90 backward kernel: one pure function of the head dim.
//
// A CTA owns kBlockN keys of one KV head and walks the query blocks of kBlockM rows that see them, for every query
// head of the GQA group, with two MMA warpgroups (setmaxnreg 240 registers per thread). dK and dV stay in registers
// for the whole sweep, so their size decides how the warpgroups share the work:
//   kByKeys (D <= 128): kBlockN = 128, warpgroup w owns keys 64w .. 64w + 63 over all of D. Per thread dK + dV take
//     2 * 64 * D / 128 f32, S^T + dP^T 2 * 64 * kBlockM / 128, the dQ share kBlockM * D / 256; P^T and dS^T feed the
//     dK / dV GEMMs from registers.
//   kByHeadDim (D > 128, where dK + dV alone would take 192 or 256 of the 240): kBlockN = 64, both warpgroups see
//     all 64 keys. Warpgroup w computes S^T and dP^T for query columns [w, w + 1) * kBlockM / 2, both write P^T and
//     dS^T to shared memory, and then w accumulates dK and dV for all keys but columns [w, w + 1) * D / 2 of D (SS
//     GEMMs): dK + dV take 2 * 64 * D / 256 f32 per thread.
// Shared memory holds K, V (kBlockN x D each), kStages of Q and of dO (kBlockM x D), dS (and P with kByHeadDim;
// kBlockM x kBlockN, 16-bit) and the dQ staging buffer (kBlockM x D, f32), all under 227 KB.
// fp16 and bf16 have the same size and wgmma shapes, so the element type does not change the choice.
#pragma once

namespace flashjax::sm90 {

enum class BwdWarpgroupSplit {
  kByKeys,     // each MMA warpgroup owns 64 of the CTA's keys
  kByHeadDim,  // the warpgroups share the keys; split by query columns for S^T / dP^T, by D for dK / dV and dQ
};

struct BwdTileSizes {
  int block_m;  // query rows per step (Q / dO tile); also the N of S^T = K Q^T and the K of dK / dV
  int block_n;  // keys per CTA
  int stages;   // Q and dO buffers each: with 2 the next step's tiles load during this one
  int dq_passes;  // dQ GEMMs per step, each for a column slice of D (2: half the dQ accumulator registers)
  BwdWarpgroupSplit split;
};

constexpr BwdTileSizes bwd_tile_sizes(int head_dim) {
  // D = 64, 96 and 128: 64-row steps. At D = 128 dK + dV take 128 registers, S^T + dP^T 64, dQ 32: 224 of 240
  // (177 KB). At D = 64, FlashAttention-3's 128-row steps (S^T + dP^T 128, dK + dV 64, dQ 32, P^T and dS^T 64 more
  // while the dK / dV GEMMs read them) spilled 904 bytes here (each thread also reads the LSE and D' of its 32 query
  // columns); 64-row steps spill 136 bytes with nvcc 13.0 (98 KB). D = 96: dK + dV 96, S^T + dP^T 64, dQ 24 (its
  // wgmma N is 48: D split over the two warpgroups); 137 KB.
  if (head_dim <= 128) return {64, 128, 2, 1, BwdWarpgroupSplit::kByKeys};
  // D = 192 and 256: dK + dV 96 / 128 registers, S^T + dP^T 32 (wgmma N = 32 query columns per warpgroup), dQ 48 /
  // 64 in one GEMM. With the SS GEMMs' descriptors that spilled dK around the dQ GEMM (ptxas: 608 / 1336 bytes), so
  // dQ is two GEMMs per step over column slices of D (24 / 32 registers), the first staged while dK's GEMM runs.
  // Shared memory: K + V 48 / 64 KB, P + dS 16 KB, dQ staging 48 / 64 KB, Q + dO 48 / 64 KB per stage: two stages
  // fit at D = 192 (209 KB), one at D = 256 (209 KB; two would be 273). FlashAttention-3 at these widths takes
  // 64-row steps too, with one dO stage.
  return {64, 64, head_dim <= 192 ? 2 : 1, 2, BwdWarpgroupSplit::kByHeadDim};
}

}  // namespace flashjax::sm90

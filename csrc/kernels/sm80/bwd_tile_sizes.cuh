// Tile sizes of the sm80-family backward kernel: one pure function of the head dim.
#pragma once

namespace flashjax::sm80 {

// Rows of the per-row workspace (dq_accum, dpsum, lse_log2) are padded to a multiple of this (BwdParams::
// seqlen_q_rounded; Python's bwd_seqlen_q_rounding must match), so that whole M blocks of the main kernel and
// whole blocks of the row passes stay inside the workspace without row predicates.
inline constexpr int kBwdSeqlenQRounding = 128;

struct BwdTileSizes {
  int block_m;     // query rows per inner step (one Q / dO tile)
  int block_n;     // keys owned by one CTA (its K / V tile, and its dK / dV accumulators)
  int warps;
  int atom_m_sdp;  // warps along M in S = Q K^T and dP = dO V^T (the rest tile N)
  int atom_n_dkv;  // warps along N (keys) in dK = dS^T Q and dV = P^T dO (the rest tile D)
  int atom_m_dq;   // warps along M in dQ = dS K (the rest tile D)
  int stages;      // Q / dO shared-memory buffers: 2 overlaps the next tile's load with this tile's MMAs
};

// Starting point: FlashAttention-2's Ampere table. Per thread, with T = 32 * warps threads, the dK and dV
// accumulators live in registers for the whole CTA (2 * block_n * D / T f32), and each step adds S and dP
// (2 * block_m * block_n / T f32); with the MMA operands and shared-memory addresses on top, that is what the
// 255-register cap bounds (tools/check_compile.sh sm80 bwd prints what ptxas made of it).
// Shared memory is stages * (Q + dO) + K + V + P + dS:
//   2 bytes * (2 * stages * block_m * D + 2 * block_n * D + 2 * block_m * block_n),
// which must stay under sm80's 163 KB per CTA so that one binary serves sm80 and sm90 (227 KB).
// fp16 and bf16 have the same size and MMA shape, so the element type does not change the choice.
constexpr BwdTileSizes bwd_tile_sizes(int head_dim) {
  // D = 64: FA2's 128-row steps hold 192 regs of accumulators (S + dP 128, dK + dV 64) and spilled ~190 bytes
  // on sm90a; 64-row steps hold 128 and compile without spills. 96 KB.
  if (head_dim <= 64) return {64, 128, 8, 2, 4, 4, 2};
  // D = 96: dK + dV take 96 regs; 64-row steps keep S + dP at 64. 128 KB.
  if (head_dim <= 96) return {64, 128, 8, 2, 4, 4, 2};
  // D = 128: dK + dV take 128 regs, S + dP 64: the register budget is full. 160 KB.
  if (head_dim <= 128) return {64, 128, 8, 2, 4, 2, 2};
  // D = 192: 128-key CTAs would need 192 regs of dK + dV; 64 keys need 96. 160 KB.
  if (head_dim <= 192) return {64, 64, 8, 4, 2, 2, 2};
  // D = 256: dK + dV take 128 regs. Double-buffered Q / dO would need 208 KB (over sm80's 163 KB), so a
  // single buffer (144 KB): the next dO then loads behind this step's dQ and dK MMAs, the next Q is exposed.
  return {64, 64, 8, 4, 2, 2, 1};
}

// Columns of dQ = dS K computed per pass. Its accumulator (block_m x cols per CTA) is live next to the dK and dV
// ones, so wide heads split it to keep it at 32 regs/thread or less. A chunk is all of D or a multiple of the
// 64-column swizzle atom, so that slicing K^T stays on atom boundaries.
constexpr int bwd_dq_chunk_cols(int block_m, int head_dim, int threads) {
  if (block_m * head_dim / threads <= 32) return head_dim;
  for (int cols = head_dim - 64; cols > 64; cols -= 64) {
    if (head_dim % cols == 0 && block_m * cols / threads <= 32) return cols;
  }
  return 64;
}

}  // namespace flashjax::sm80

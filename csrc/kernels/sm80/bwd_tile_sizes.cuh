// Tile sizes of the sm80-family backward kernel: one pure function of the head dim and of the shared memory per
// block the configuration may use (its budget, a template argument of each instantiation: tools/gen_kernels.py).
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
  int stages_q;    // Q shared-memory buffers: 2 loads the next step's Q during this step, 1 after this step's dK
  int stages_do;   // dO buffers: 2 likewise; 1 loads the next dO once this step's dV is done (behind dQ and dK)
  bool v_in_regs;  // V goes to registers once per CTA, and P / dS take its shared memory
};

// Shared memory of a configuration, in bytes (2-byte elements): stages_q Q tiles, stages_do dO tiles, K, V, P, dS, with
// P and dS inside V's tile when V lives in registers. BwdLayouts carves exactly this (it static_asserts so).
constexpr int bwd_tile_smem_bytes(const BwdTileSizes& t, int head_dim) {
  const int q_do = (t.stages_q + t.stages_do) * t.block_m * head_dim;
  const int kv = t.block_n * head_dim;
  const int p_ds = 2 * t.block_m * t.block_n;
  return 2 * (q_do + kv + (t.v_in_regs ? (kv > p_ds ? kv : p_ds) : kv + p_ds));
}

// `preferred` where it fits smem_kb KB, else `smaller` (which must: BwdLayouts static_asserts its budget).
constexpr BwdTileSizes bwd_largest_fitting(int head_dim, int smem_kb, const BwdTileSizes& preferred,
                                           const BwdTileSizes& smaller) {
  return bwd_tile_smem_bytes(preferred, head_dim) <= smem_kb * 1024 ? preferred : smaller;
}

// The largest configuration that fits smem_kb KB per block (the builds compile 163, sm80's limit, which sm90 and
// sm100 run too, and 99, that of sm86, sm89 and sm120; dispatch takes the largest row that fits the device).
// Starting point: FlashAttention-2's Ampere table. Per thread, with T = 32 * warps threads, the dK and dV accumulators
// live in registers for the whole CTA (2 * block_n * D / T f32), and each step adds S and dP (2 * block_m * block_n / T
// f32); with the MMA operands and shared-memory addresses on top, that is what the 255-register cap bounds
// (tools/check_compile.sh sm80 bwd prints what ptxas made of it). Every configuration has 8 warps: with one CTA per
// SM (all of these take more than half of any SM's shared memory) fewer would leave the tensor cores idle while a
// warp waits. Global traffic (Q and dO loads, dQ atomics) goes as 1 / block_n: each CTA rereads every Q / dO tile
// of its band, so the smaller configurations keep block_n and shrink block_m or the stages first.
// fp16 and bf16 have the same size and MMA shape, so the element type does not change the choice.
constexpr BwdTileSizes bwd_tile_sizes(int head_dim, int smem_kb) {
  // D = 64: FA2's 128-row steps hold 192 regs of accumulators (S + dP 128, dK + dV 64) and spilled ~190 bytes
  // on sm90a; 64-row steps hold 128 and compile without spills. 96 KB, which fits 99 KB too.
  if (head_dim <= 64) return {64, 128, 8, 2, 4, 4, 2, 2, false};
  // D = 96: dK + dV take 96 regs; 64-row steps keep S + dP at 64. 128 KB. In 99 KB: 64 keys per CTA (88 KB; dK + dV
  // 48 regs); 128 keys with one dO buffer would need 116 KB, and 32-row steps cannot tile dQ's 96 columns on 8 warps.
  if (head_dim <= 96) {
    return bwd_largest_fitting(head_dim, smem_kb, {64, 128, 8, 2, 4, 4, 2, 2, false},
                               {64, 64, 8, 4, 4, 4, 2, 2, false});
  }
  // D = 128: dK + dV take 128 regs, S + dP 64: the register budget is full. 160 KB. In 99 KB: FA2's sm86 choice,
  // 64 keys per CTA with a double-buffered Q and one dO buffer (96 KB); both double-buffered would need 112 KB.
  if (head_dim <= 128) {
    return bwd_largest_fitting(head_dim, smem_kb, {64, 128, 8, 2, 4, 2, 2, 2, false},
                               {64, 64, 8, 4, 2, 2, 2, 1, false});
  }
  // D = 192: 128-key CTAs would need 192 regs of dK + dV; 64 keys need 96. 160 KB. In 99 KB: 32-row steps, Q
  // double-buffered and one dO buffer (92 KB); 64-row steps need 112 KB even single-buffered, or 32 keys per CTA
  // (80 KB, twice the global traffic).
  if (head_dim <= 192) {
    return bwd_largest_fitting(head_dim, smem_kb, {64, 64, 8, 4, 2, 2, 2, 2, false},
                               {32, 64, 8, 2, 4, 2, 2, 1, false});
  }
  // D = 256: dK + dV take 128 regs. Double-buffered Q / dO would need 208 KB (over sm80's 163 KB), so a single buffer
  // (144 KB): the next dO then loads behind this step's dQ and dK MMAs, the next Q is exposed. In 99 KB: FA2's sm86
  // choice, 32 keys per CTA with V in registers (its 64 regs replace V's 16 KB, where P and dS then live): 96 KB.
  // Without that, 64 x 32 needs 104 KB, and 32 x 32 (68 KB) cannot spread S over 8 warps (32 keys take at most 2
  // warps along N, 32 rows at most 2 along M).
  return bwd_largest_fitting(head_dim, smem_kb, {64, 64, 8, 4, 2, 2, 1, 1, false}, {64, 32, 8, 4, 1, 2, 1, 1, true});
}

// Columns of dQ = dS K computed per pass. Its accumulator (block_m x cols per CTA) is live next to the dK and dV
// ones, so wide heads split it to keep it at max_regs regs/thread or less: 32, or 16 where V's 64 take registers too
// (with 32, ptxas spilled 16-24 bytes in the D = 256 99 KB row; with 16, none on sm_80, sm_90a and sm_120). A chunk is
// all of D or a multiple of the 64-column swizzle atom, so that slicing K^T stays on atom boundaries.
constexpr int bwd_dq_chunk_cols(int block_m, int head_dim, int threads, int max_regs) {
  if (block_m * head_dim / threads <= max_regs) return head_dim;
  for (int cols = head_dim - 64; cols > 64; cols -= 64) {
    if (head_dim % cols == 0 && block_m * cols / threads <= max_regs) return cols;
  }
  return 64;
}

}  // namespace flashjax::sm80

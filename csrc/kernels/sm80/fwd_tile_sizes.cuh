// Tile sizes of the sm80-family forward kernel: one pure function of the head dim, the element type and the shared
// memory per block the configuration may use (its budget, a template argument of each instantiation:
// tools/gen_kernels.py).
#pragma once

namespace flashjax::sm80 {

struct FwdTileSizes {
  int block_m;  // query rows per CTA
  int block_n;  // keys per mainloop step
  int warps;    // each warp owns block_m / warps query rows (the MMA tiles warps along M only)
};

// Shared memory of a configuration, in bytes (2-byte elements): Q (block_m x D) and one K and one V tile (block_n x D
// each). FwdLayouts carves exactly this (it static_asserts so).
constexpr int fwd_tile_smem_bytes(const FwdTileSizes& t, int head_dim) {
  return 2 * (t.block_m + 2 * t.block_n) * head_dim;
}

// The largest configuration that fits smem_kb KB per block (the builds compile 163, sm80's limit, which sm90 and
// sm100 run too, and 99, that of sm86, sm89 and sm120; dispatch takes the largest row that fits the device).
// Starting point: FlashAttention-2's Ampere table, which also suits Hopper when this family is the fallback.
// Registers dominate: per thread the f32 O accumulator holds block_m * D / threads values and the score tile
// block_m * block_n / threads, and both must stay under the 255-register cap with no spills.
// fp16 and bf16 have the same size and MMA shape, so the element type does not change the choice.
template <typename Element>
constexpr FwdTileSizes fwd_tile_sizes(int head_dim, int smem_kb) {
  // D = 64: 64-key steps, like D = 128. FA2's 128-key step (S: 128 regs/thread) halves the softmax/rescale work
  // per key, but with the band mask and the ldmatrix double buffers it needs more than 255 registers: ptxas spilled
  // ~400 bytes in the masked step. Measured on the H200 (docs/performance.md): +46% at S = 512 causal (where 40% of
  // the blocks are masked), +6-22% on the other causal rows, +1-5% non-causal from S = 2k, -5% at S = 512.
  if (head_dim <= 64) return {128, 64, 4};
  // D = 96 / 128: O takes 96 / 128 regs/thread; 64-key steps keep S at 64 regs. 48 / 64 KB smem: 2 CTAs per SM
  // (sm80 163 KB, sm90 227 KB), which is what hides the mma.sync / exp2 latency.
  if (head_dim <= 128) return {128, 64, 4};
  // D = 192 / 256: with 4 warps O would need 192 / 256 regs/thread, so 8 warps share the 128 rows (96 / 128 regs).
  // 96 / 128 KB smem: one CTA per SM on sm80, which the 8 warps keep busy. 96 KB fits 99 KB too.
  // In 99 KB at D = 256: FA2's sm86 choice, 64 rows on 4 warps (O 128 regs, S 32, as in the 128-row tile) and 64-key
  // steps: 96 KB. (64 rows cannot spread over 8 warps: each warp takes 16-row MMA steps.)
  constexpr FwdTileSizes kWide = {128, 64, 8};
  if (head_dim <= 192 || fwd_tile_smem_bytes(kWide, head_dim) <= smem_kb * 1024) return kWide;
  return {64, 64, 4};
}

}  // namespace flashjax::sm80

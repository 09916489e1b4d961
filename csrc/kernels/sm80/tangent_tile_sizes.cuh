// Tile sizes of the sm80-family tangent kernel (forward-mode derivative, tangent_kernel.cuh): one pure function of
// the head dim and the shared memory per block its instantiation is compiled for (tools/gen_kernels.py's budgets).
#pragma once

#include "kernels/sm80/fwd_tile_sizes.cuh"

namespace flashjax::sm80 {

// The same three numbers as the forward's tiles (query rows, keys per step, warps).
using TangentTileSizes = FwdTileSizes;

// Shared memory of a configuration, in bytes (2-byte elements): Q and its tangent tQ (block_m x D each), and one
// K, tK, V and tV tile (block_n x D each). TangentLayouts carves exactly this (it static_asserts so).
constexpr int tangent_tile_smem_bytes(const TangentTileSizes& t, int head_dim) {
  return 2 * (2 * t.block_m + 4 * t.block_n) * head_dim;
}

// The largest configuration that fits smem_kb KB per block (163: sm80's limit, run by sm90 and sm100 too; 99: sm86,
// sm89, sm120).
// Registers: a thread holds the f32 output-tangent accumulator (block_m * D / threads values) and two score tiles, S
// and its tangent tS (block_m * block_n / threads each), live together from the score GEMMs until P and P * tS are
// packed into bf16 / fp16 A operands. With the forward's 128 rows on 4 warps that is 128 + 64 + 64 f32 registers at
// D 128, over the 255 cap before any operand fragment; 64 rows on 4 warps (16 rows a warp, 2 rows a thread) halve
// all three, which leaves room for the operand fragments of the fused score GEMM (Q, tQ, K and tK slices). The
// 128-row alternative (8 warps, one K / V fetch serving twice the rows) is not measured yet.
// Keys per step: 64 up to D 128 (each step's barriers and mask work spread over as many keys as the forward's), 32
// above: at D 192 the 64-key step needs more than 255 registers (ptxas, sm_80: 92 / 112 bytes spilled in the uncapped
// / capped kernel and a 3840-byte stack frame; 32 keys: none); then halved while the six tiles exceed the budget.
//   D <= 128: 64 x 64: 48 / 72 / 96 KB at D 64 / 96 / 128 (fits 99 KB; 2 CTAs per SM on sm90's 227 KB).
//   D 192:    64 x 32: 96 KB (fits 99 KB too).
//   D 256:    64 x 32 (128 KB) in 163 KB; 64 x 16 (96 KB) in 99 KB.
// The output-tangent accumulator is 128 f32 registers at D 256 (as in the forward's 8-warp tile), the score tiles 16
// (32 keys) or 8 (16 keys) each.
template <typename Element>
constexpr TangentTileSizes tangent_tile_sizes(int head_dim, int smem_kb) {
  for (int block_n = head_dim <= 128 ? 64 : 32; block_n >= 16; block_n /= 2) {
    const TangentTileSizes tile = {64, block_n, 4};
    if (tangent_tile_smem_bytes(tile, head_dim) <= smem_kb * 1024) return tile;
  }
  return {64, 16, 4};  // no budget below 99 KB is compiled; TangentLayouts' static_assert catches one that would be
}

}  // namespace flashjax::sm80

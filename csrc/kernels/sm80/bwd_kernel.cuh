// The sm80 backward main kernel: one CTA per (KV block, kv head, batch), or per virtual KV block of the packed
// sequences (varlen). It only wires the stages: the tile scheduler (bwd_tile_scheduler.cuh) names the CTA's keys
// and their sequence, the mainloop (bwd_mainloop.cuh) accumulates dK / dV over the GQA group and the band's M
// blocks, adding dQ into the f32 workspace; the epilogue (bwd_epilogue.cuh) writes dK / dV once.
//
// Varlen is a runtime branch (the tile's row offsets and used lengths, from bwd_tile_scheduler.cuh), not a second
// instantiation. Measured (tools/check_compile.sh sm80 bwd bf16 128 128:99, before -> after the branch): sm_90a, the
// 163 KB row, both twins 255 registers with no spills, unchanged; sm_80, the 163 KB row, uncapped unchanged (255, no
// spills), capped spills 32 / 36 -> 4 / 4 bytes (stack 32 -> 8); sm_80, the 99 KB row, 223 -> 233 and 235 -> 246
// registers, no spills either way (one CTA per SM, so registers below 255 cost no occupancy); sm_80, D 64, unchanged
// (255, no spills); sm_80, D 256's 99 KB row (V in registers), the uncapped twin spills 8 / 8 bytes (0 before), the
// capped one unchanged (no spills). Deriving the tile again for the epilogue, instead of keeping it live across the
// mainloop, spilled more (32 / 24 bytes at D 256 99 KB, 32 / 32 at D 128 capped). A compile-time variant (twice the
// kernels) stays the fallback should the H200's timings show a cost.
#pragma once

#include <cute/tensor.hpp>

#include "flashjax/mask_grid.h"
#include "flashjax/params.h"
#include "kernels/common/bwd_band_mask.cuh"
#include "kernels/sm80/bwd_epilogue.cuh"
#include "kernels/sm80/bwd_layouts.cuh"
#include "kernels/sm80/bwd_mainloop.cuh"
#include "kernels/sm80/bwd_tile_scheduler.cuh"

namespace flashjax::sm80 {

// Grid: BwdBlockScheduler<kBlockN, keys>::grid; Layouts::kNThreads threads; Layouts::kSmemBytes dynamic smem.
// Needs the preprocess (workspace rows, zeroed dq_accum) to have run on the same stream.
// kSoftcap: whether params.softcap > 0 (see bwd_mainloop_sm80). kMaskMod: whether params.mask_bits is set (the
// launcher classified the tiles first): a compile-time twin, so that the kernel without a mask mod keeps its code.
// Measured (tools/check_compile.sh sm80 bwd bf16 128, sm_80, the 163 KB row): without a mod unchanged (255 registers,
// no spills uncapped, 4 / 4 bytes capped); the mask twins 255 registers, 176 / 180 and 172 / 212 bytes spilled, the
// same with varlen (the bits' padded grid and the cut, flashjax/mask_grid.h; the twins without a mod SASS identical).
template <typename Layouts, bool kSoftcap, bool kMaskMod>
__global__ void __launch_bounds__(Layouts::kNThreads, 1) bwd_kernel_sm80(const BwdParams params) {
  using namespace cute;
  using Element = typename Layouts::Element;
  extern __shared__ __align__(128) char smem_bytes[];  // as the forward declares it (one TU may hold both)
  Element* smem = reinterpret_cast<Element*>(smem_bytes);
  static_assert(kBwdVarlenRowBlock % Layouts::kBlockM == 0, "varlen M blocks must stay whole in a sequence's rows");
  BwdBlock tile = BwdBlockScheduler<Layouts::kBlockN, /*kKeys=*/true>::block(params);
  // Varlen with a mask mod: a sequence longer than the bits' padded grid is cut to it (mask_grid.h).
  if constexpr (kMaskMod) cut_to_mask_grid(params, tile.seq.seqlen_q, tile.seq.seqlen_k);
  // Varlen: a virtual block before its sequence's start or past its used keys; the launcher zeroed its rows, if any.
  if (tile.block < 0 || tile.block * Layouts::kBlockN >= tile.seq.seqlen_k) return;
  // Bottom-right alignment per sequence: the band is its used lengths'.
  const common::BwdBandMask mask(tile.seq.seqlen_q, tile.seq.seqlen_k, params.window_left, params.window_right);

  typename Layouts::TiledMmaDkv mma_dkv;
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<Layouts::kBlockN>, Int<Layouts::kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<Layouts::kBlockN>, Int<Layouts::kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  bwd_mainloop_sm80<Layouts, kSoftcap, kMaskMod>(params, mask, tile, smem, acc_dk, acc_dv);
  bwd_epilogue_store_dkdv<Layouts>(params, tile, smem, acc_dk, acc_dv);
}

}  // namespace flashjax::sm80

// The sm80-family forward kernel: wires tile scheduler, band, mainloop, softmax finalization and epilogue.
// One instantiation per (Element, head dim, softcap on/off) covers every feature: causal/local band, GQA, sinks,
// ragged sizes and varlen (packed sequences, fwd_tile_scheduler.cuh) are runtime decisions, taken per CTA or per KV
// block (see band_mask.cuh and fwd_mainloop.cuh).
// Softcap is a compile-time switch because, as a uniform runtime branch in the mainloop, ptxas if-converted the tanh
// code and every uncapped KV block issued it predicated off (~320 of ~1200 instructions per warp at D = 128). It is a
// separate kernel, not a second copy of the loop in this one: with both copies inlined into one function the capped
// copy lost its full unrolling and kept its fragments in local memory. The capped kernel keeps the runtime-checked
// apply_softcap on purpose: its predicated form compiled to ~200 fewer register moves per block than an unchecked one.
#pragma once

#include <cute/tensor.hpp>

#include "flashjax/mask_grid.h"
#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/online_softmax.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm80/fwd_epilogue.cuh"
#include "kernels/sm80/fwd_layouts.cuh"
#include "kernels/sm80/fwd_mainloop.cuh"
#include "kernels/sm80/fwd_tile_scheduler.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"

namespace flashjax::sm80 {

// Min 1 CTA/SM lets the compiler use up to 255 registers: the O accumulator alone takes 64-128 of them.
// kMaskMod (params.mask_bits != nullptr; the tile classes written before this kernel): a compile-time twin like
// kSoftcap, so that the kernel without a mask mod keeps its code and registers exactly (fwd_mainloop.cuh). Measured
// (tools/check_compile.sh sm80 fwd bf16 128, sm_80): without a mod unchanged (255 registers, 172 / 216 and 168 / 208
// bytes spilled, 112-byte stack); the mask twins 255 registers, 464 / 500 (uncapped) and 404 / 444 (capped) bytes
// spilled, of which the loop over classes alone (the bits apply left out) costs 192 / 216 and 244 / 268. With varlen
// (the bits' padded grid and the cut, flashjax/mask_grid.h): 472 / 512 and 388 / 428, the twins without a mod
// unchanged (SASS identical).
template <typename Layouts, bool kSoftcap, bool kMaskMod>
__global__ void __launch_bounds__(Layouts::kNThreads, 1) fwd_kernel_sm80(const __grid_constant__ FwdParams params) {
  using namespace cute;
  using Element = typename Layouts::Element;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kBlockN = Layouts::kBlockN;
  constexpr int kHeadDim = Layouts::kHeadDim;
  extern __shared__ __align__(128) char smem_bytes[];
  Element* smem = reinterpret_cast<Element*>(smem_bytes);

  auto tile = FwdTileScheduler<kBlockM>::tile(params, blockIdx.x);
  // Varlen with a mask mod: a sequence longer than the bits' padded grid is cut to it (mask_grid.h).
  if constexpr (kMaskMod) cut_to_mask_grid(params, tile.seqlen_q, tile.seqlen_k);
  const int head_k = tile.head_q / (params.heads_q / params.heads_k);  // GQA: K/V are read in place, never expanded
  const int m_start = tile.m_block * kBlockM;
  // Varlen: a virtual block past its sequence's rows (fwd_tile_scheduler.cuh); its rows, if any, the launcher filled.
  if (m_start >= tile.seqlen_q) return;

  // Bottom-right alignment per sequence: the band is its used lengths'.
  const common::BandMask band(tile.seqlen_q, tile.seqlen_k, params.window_left, params.window_right);
  const FwdMainloopArgs args{tile.seqlen_q - m_start, tile.seqlen_k,
                             band.template kv_blocks<kBlockM, kBlockN>(m_start), band.tile_mask(m_start),
                             common::ScoreTransform(params.softmax_scale, params.softcap)};

  // 64-bit element offsets: batch/head strides times indices overflow int32 on large tensors. The tensors start at
  // the sequence's first row (varlen; 0 when dense) and hold its rows only: loads and stores predicated by them never
  // touch a neighbouring sequence's.
  const auto* q = static_cast<const Element*>(params.q) + tile.batch * params.q_batch_stride +
                  tile.q_start * params.q_row_stride + tile.head_q * params.q_head_stride;
  const auto* k = static_cast<const Element*>(params.k) + tile.batch * params.k_batch_stride +
                  tile.k_start * params.k_row_stride + head_k * params.k_head_stride;
  const auto* v = static_cast<const Element*>(params.v) + tile.batch * params.v_batch_stride +
                  tile.k_start * params.v_row_stride + head_k * params.v_head_stride;
  auto* o = static_cast<Element*>(params.o) + tile.batch * params.o_batch_stride +
            tile.q_start * params.o_row_stride + tile.head_q * params.o_head_stride;
  Tensor m_q = make_tensor(make_gmem_ptr(q), make_shape(tile.seqlen_q, Int<kHeadDim>{}),
                           make_stride(params.q_row_stride, _1{}));
  Tensor m_k = make_tensor(make_gmem_ptr(k), make_shape(tile.seqlen_k, Int<kHeadDim>{}),
                           make_stride(params.k_row_stride, _1{}));
  Tensor m_v = make_tensor(make_gmem_ptr(v), make_shape(tile.seqlen_k, Int<kHeadDim>{}),
                           make_stride(params.v_row_stride, _1{}));
  Tensor m_o = make_tensor(make_gmem_ptr(o), make_shape(tile.seqlen_q, Int<kHeadDim>{}),
                           make_stride(params.o_row_stride, _1{}));
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  Tensor g_q = local_tile(m_q, TileQ{}, make_coord(tile.m_block, 0));
  Tensor g_k = local_tile(m_k, TileKV{}, make_coord(_, 0));  // (kBlockN, D, n_blocks)
  Tensor g_v = local_tile(m_v, TileKV{}, make_coord(_, 0));
  Tensor g_o = local_tile(m_o, TileQ{}, make_coord(tile.m_block, 0));

  typename Layouts::TiledMma tiled_mma;
  Tensor acc_o = partition_fragment_C(tiled_mma, TileQ{});
  clear(acc_o);
  common::OnlineSoftmax<Layouts::kRowsPerThread> softmax(args.transform.exp2_scale);
  // A tile none of whose rows sees a key skips the loop (nothing is loaded): out = 0, lse = -inf / sink.
  FwdMaskModArgs mod;
  if constexpr (kMaskMod) {
    // The bits and classes as a dense grid (varlen: b the sequence, rows and keys local to it; mask_grid.h).
    const AttnShape grid = mask_bits_grid(params);
    mod.classes = common::MaskTileClasses<kBlockM, kBlockN>::row(grid, tile.mod_batch, tile.head_q, tile.m_block);
    mod.bits = common::MaskBitsRows::of(grid, tile.mod_batch, tile.head_q);
    mod.m_start = m_start;
  }
  if (!args.blocks.empty()) {
    fwd_mainloop_sm80<Layouts, kSoftcap, kMaskMod>(g_q, g_k, g_v, args, mod, smem, acc_o, softmax);
  }

  const float sink_log2 = params.sinks != nullptr ? params.sinks[tile.head_q] * common::kLog2e : -INFINITY;
  float lse[Layouts::kRowsPerThread];
  Tensor acc_o_rc = common::acc_rowcol_view(acc_o);
  softmax.finalize(acc_o_rc, sink_log2, lse);

  float* lse_tile = params.lse != nullptr ? params.lse + tile.batch * params.lse_batch_stride +
                                                tile.head_q * params.lse_head_stride + tile.q_start + m_start
                                          : nullptr;
  fwd_epilogue_sm80<Layouts>(acc_o, lse, g_o, lse_tile, args.rows_valid_q, smem);
}

}  // namespace flashjax::sm80

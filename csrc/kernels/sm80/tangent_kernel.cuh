// The sm80-family tangent kernel (jax.jvp of attention, issue 39): wires the forward's tile scheduler and band, the
// tangent mainloop (tangent_mainloop.cuh) and epilogue (tangent_epilogue.cuh). One CTA per (batch, query head,
// query block), like the forward; its rows' lse comes from the forward, so each key block's P is exact and the
// tangent needs one pass over the blocks the band shows the tile, with no rescaling.
// Softcap is a compile-time twin for the forward's reason (fwd_kernel.cuh): the tanh code and tanh' stay out of the
// uncapped kernel. So is a mask mod (kMaskMod: params.mask_bits != nullptr, the tile classes for this kernel's tiles
// written before it), as in the forward: the kernel without one keeps its code exactly. Positions the bits hide get
// P = 0 and add nothing to t_out or t_lse; rows that see no key at all have lse = -inf (or the sink's) from the
// forward, so P = 0 on every key and t_out = 0, t_lse = P_sink t_sink, as for rows the band leaves empty.
#pragma once

#include <cute/tensor.hpp>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm80/fwd_mainloop.cuh"
#include "kernels/sm80/fwd_tile_scheduler.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"
#include "kernels/sm80/tangent_epilogue.cuh"
#include "kernels/sm80/tangent_layouts.cuh"
#include "kernels/sm80/tangent_mainloop.cuh"

namespace flashjax::sm80 {

template <typename Layouts, bool kSoftcap, bool kMaskMod>
__global__ void __launch_bounds__(Layouts::kNThreads, 1)
    tangent_kernel_sm80(const __grid_constant__ TangentParams params) {
  using namespace cute;
  using Element = typename Layouts::Element;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kBlockN = Layouts::kBlockN;
  constexpr int kHeadDim = Layouts::kHeadDim;
  constexpr int kRows = Layouts::kRowsPerThread;
  extern __shared__ __align__(128) char smem_bytes[];
  Element* smem = reinterpret_cast<Element*>(smem_bytes);

  const auto tile = FwdTileScheduler<kBlockM>::tile(params, blockIdx.x);
  const int head_k = tile.head_q / (params.heads_q / params.heads_k);  // GQA: K/V and their tangents read in place
  const int m_start = tile.m_block * kBlockM;
  if (m_start >= tile.seqlen_q) return;

  const common::BandMask band(tile.seqlen_q, tile.seqlen_k, params.window_left, params.window_right);
  const FwdMainloopArgs args{tile.seqlen_q - m_start, tile.seqlen_k,
                             band.template kv_blocks<kBlockM, kBlockN>(m_start), band.tile_mask(m_start),
                             common::ScoreTransform(params.softmax_scale, params.softcap)};

  // 64-bit element offsets (fwd_kernel.cuh); each tangent has its primal's strides (params.h).
  const int64_t q_offset =
      tile.batch * params.q_batch_stride + tile.q_start * params.q_row_stride + tile.head_q * params.q_head_stride;
  const int64_t k_offset =
      tile.batch * params.k_batch_stride + tile.k_start * params.k_row_stride + head_k * params.k_head_stride;
  const int64_t v_offset =
      tile.batch * params.v_batch_stride + tile.k_start * params.v_row_stride + head_k * params.v_head_stride;
  const int64_t o_offset =
      tile.batch * params.o_batch_stride + tile.q_start * params.o_row_stride + tile.head_q * params.o_head_stride;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  auto q_tile = [&](const void* base, int64_t offset, int64_t row_stride) {
    Tensor m = make_tensor(make_gmem_ptr(static_cast<const Element*>(base) + offset),
                           make_shape(tile.seqlen_q, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
    return local_tile(m, TileQ{}, make_coord(tile.m_block, 0));
  };
  auto kv_tiles = [&](const void* base, int64_t offset, int64_t row_stride) {  // (kBlockN, D, n_blocks)
    Tensor m = make_tensor(make_gmem_ptr(static_cast<const Element*>(base) + offset),
                           make_shape(tile.seqlen_k, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
    return local_tile(m, TileKV{}, make_coord(_, 0));
  };
  Tensor m_t_out = make_tensor(make_gmem_ptr(static_cast<Element*>(params.t_out) + o_offset),
                               make_shape(tile.seqlen_q, Int<kHeadDim>{}), make_stride(params.o_row_stride, _1{}));
  Tensor g_t_out = local_tile(m_t_out, TileQ{}, make_coord(tile.m_block, 0));

  // The thread's rows' lse in log2 units; +inf where the forward found no visible key (lse = -inf) and on padding
  // rows, so that their P is 0 (tangent_probs) and their t_lse 0.
  typename Layouts::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(threadIdx.x);
  Tensor rows_rc =
      common::acc_rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  const int64_t lse_offset = tile.batch * params.lse_batch_stride + tile.head_q * params.lse_head_stride +
                             tile.q_start + m_start;
  float lse_log2[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(rows_rc(r, 0));
    const float lse = row < args.rows_valid_q ? params.lse[lse_offset + row] : -INFINITY;
    lse_log2[r] = lse == -INFINITY ? INFINITY : lse * common::kLog2e;
  }

  Tensor acc_o = partition_fragment_C(tiled_mma, TileQ{});
  clear(acc_o);
  float w_sum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) w_sum[r] = 0.f;
  // A tile none of whose rows sees a key skips the loop: t_out = 0 and t_lse = P_sink t_sink.
  FwdMaskModArgs mod;
  if constexpr (kMaskMod) {
    mod.classes = common::MaskTileClasses<kBlockM, kBlockN>::row(params, tile.batch, tile.head_q, tile.m_block);
    mod.bits = common::MaskBitsRows::of(params, tile.batch, tile.head_q);
    mod.m_start = m_start;
  }
  if (!args.blocks.empty()) {
    tangent_mainloop_sm80<Layouts, kSoftcap, kMaskMod>(
        q_tile(params.q, q_offset, params.q_row_stride), q_tile(params.tq, q_offset, params.q_row_stride),
        kv_tiles(params.k, k_offset, params.k_row_stride), kv_tiles(params.tk, k_offset, params.k_row_stride),
        kv_tiles(params.v, v_offset, params.v_row_stride), kv_tiles(params.tv, v_offset, params.v_row_stride), args,
        mod, params.softmax_scale, lse_log2, smem, acc_o, w_sum);
  }

  const bool has_sinks = params.sinks != nullptr;
  const float sink_log2 = has_sinks ? params.sinks[tile.head_q] * common::kLog2e : -INFINITY;
  float t_lse[kRows];
  tangent_lse(w_sum, lse_log2, sink_log2, has_sinks ? params.tsinks[tile.head_q] : 0.f, t_lse);
  tangent_epilogue_sm80<Layouts>(acc_o, t_lse, q_tile(params.o, o_offset, params.o_row_stride), g_t_out,
                                 params.t_lse + lse_offset, args.rows_valid_q, smem);
}

}  // namespace flashjax::sm80

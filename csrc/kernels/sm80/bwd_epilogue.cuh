// Epilogue of the sm80 backward: dK = softmax_scale * acc_dk and dV = acc_dv, converted to Element, staged through
// shared memory (where K and V were: the mainloop is done with them) and stored with 16-byte row-predicated writes.
// Each CTA owns its keys for the whole GQA group, so dK / dV are written once, with no atomics: deterministic.
#pragma once

#include <cute/tensor.hpp>

#include "flashjax/params.h"
#include "kernels/sm80/bwd_layouts.cuh"
#include "kernels/sm80/bwd_tile_scheduler.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"

namespace flashjax::sm80 {

// Stores a (kBlockN x D) tile from shared memory to rows [n_start, Sk) of a [B, Sk, H, D] tensor.
template <typename Layouts, typename SmemTile>
__device__ __forceinline__ void store_tile_rows(const SmemTile& smem_tile, void* base, int64_t batch_offset,
                                                int64_t row_stride, int64_t head_offset, int n_start, int seqlen) {
  using namespace cute;
  using Element = typename Layouts::Element;
  Element* ptr = static_cast<Element*>(base) + batch_offset + head_offset + n_start * row_stride;
  Tensor gmem = make_tensor(make_gmem_ptr(ptr), Shape<Int<Layouts::kBlockN>, Int<Layouts::kHeadDim>>{},
                            make_stride(row_stride, _1{}));
  typename Layouts::GmemTiledCopyStore tiled_copy;
  auto thr_copy = tiled_copy.get_slice(threadIdx.x);
  Tensor src = thr_copy.partition_S(smem_tile);
  Tensor dst = thr_copy.partition_D(gmem);
  Tensor coords = thr_copy.partition_D(make_identity_tensor(shape(gmem)));
  Tensor staged = make_fragment_like(src);
  copy(tiled_copy, src, staged);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    if (get<0>(coords(0, m, 0)) < seqlen - n_start) copy(tiled_copy, staged(_, m, _), dst(_, m, _));
  }
}

// acc_dk / acc_dv: the mainloop's TiledMmaDkv accumulators. Expects shared memory free (the mainloop's contract).
// Writes the tile's rows of its sequence's used keys only (varlen: from the sequence's first row).
template <typename Layouts, typename AccDkv>
__device__ void bwd_epilogue_store_dkdv(const BwdParams& params, const BwdBlock& tile,
                                        typename Layouts::Element* smem, AccDkv& acc_dk, AccDkv& acc_dv) {
  using namespace cute;
  using Element = typename Layouts::Element;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= params.softmax_scale;
  Tensor rdK = common::convert_fragment<Element>(acc_dk);
  Tensor rdV = common::convert_fragment<Element>(acc_dv);

  Tensor sdK = make_tensor(make_smem_ptr(smem + Layouts::kOffsetK), typename Layouts::SmemLayoutKV{});
  Tensor sdV = make_tensor(make_smem_ptr(smem + Layouts::kOffsetV), typename Layouts::SmemLayoutKV{});
  auto copy_c = make_tiled_copy_C(typename Layouts::SmemCopyAtomStore{}, typename Layouts::TiledMmaDkv{});
  auto thr_c = copy_c.get_slice(threadIdx.x);
  copy(copy_c, thr_c.retile_S(rdK), thr_c.partition_D(sdK));
  copy(copy_c, thr_c.retile_S(rdV), thr_c.partition_D(sdV));
  __syncthreads();

  const int n_start = tile.block * Layouts::kBlockN;
  const int64_t k_start = tile.seq.k_start;
  store_tile_rows<Layouts>(sdK, params.dk, tile.seq.batch * params.dk_batch_stride + k_start * params.dk_row_stride,
                           params.dk_row_stride, tile.head * params.dk_head_stride, n_start, tile.seq.seqlen_k);
  store_tile_rows<Layouts>(sdV, params.dv, tile.seq.batch * params.dv_batch_stride + k_start * params.dv_row_stride,
                           params.dv_row_stride, tile.head * params.dv_head_stride, n_start, tile.seq.seqlen_k);
}

}  // namespace flashjax::sm80

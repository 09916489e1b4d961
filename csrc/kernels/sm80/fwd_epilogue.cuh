// Epilogue of the sm80-family forward kernel: the normalized O accumulator goes registers -> shared memory
// (through Q's buffer) -> global with 16-byte row-contiguous stores, and each row's LSE is written by the lane
// that holds its first column. Rows past Sq are never stored.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/sm80/fwd_layouts.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"

namespace flashjax::sm80 {

// acc_o: this thread's normalized (kBlockM, D) accumulator fragment; lse: its rows' LSE in acc_o's row order.
// g_o: the (kBlockM, D) output tile; lse_tile: &lse[b, h, m_start] (nullptr: not requested).
// Shared Q buffer must be free (see fwd_mainloop_sm80) and no cp.async may be pending into it.
template <typename Layouts, typename AccO, typename GO>
__device__ __forceinline__ void fwd_epilogue_sm80(const AccO& acc_o, const float (&lse)[Layouts::kRowsPerThread],
                                                  GO& g_o, float* lse_tile, int rows_valid,
                                                  typename Layouts::Element* smem) {
  using namespace cute;
  using Element = typename Layouts::Element;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kHeadDim = Layouts::kHeadDim;
  const int tid = threadIdx.x;
  typename Layouts::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);

  Tensor r_o = common::convert_fragment<Element>(acc_o);
  Tensor s_o = make_tensor(make_smem_ptr(smem), typename Layouts::SmemLayoutO{});
  auto smem_copy_o = make_tiled_copy_C(typename Layouts::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_o = smem_copy_o.get_thread_slice(tid);
  copy(smem_copy_o, smem_thr_copy_o.retile_S(r_o), smem_thr_copy_o.partition_D(s_o));

  if (lse_tile != nullptr) {
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOcO_rc = common::acc_rowcol_view(tOcO);
    if (get<1>(tOcO_rc(0, 0)) == 0) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(tOcO_rc); ++r) {
        const int row = get<0>(tOcO_rc(r, 0));
        if (row < rows_valid) lse_tile[row] = lse[r];
      }
    }
  }
  __syncthreads();  // O tile complete in shared memory

  typename Layouts::GmemTiledCopyO gmem_copy_o;
  auto gmem_thr_copy_o = gmem_copy_o.get_thread_slice(tid);
  Tensor tOsO = gmem_thr_copy_o.partition_S(s_o);
  Tensor tOgO = gmem_thr_copy_o.partition_D(g_o);
  Tensor tOcO = gmem_thr_copy_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOrO = make_fragment_like(tOsO);
  copy(gmem_copy_o, tOsO, tOrO);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOgO); ++m) {
    if (get<0>(tOcO(0, m, 0)) < rows_valid) copy(gmem_copy_o, tOrO(_, m, _), tOgO(_, m, _));
  }
}

}  // namespace flashjax::sm80

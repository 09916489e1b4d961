// Epilogue of the sm80-family tangent kernel: the row terms of the tangent, then the store.
//   t_lse = rowsum(W) + P_sink t_sink,  P_sink = exp(sink - lse)  (clamped to [0, 1]: see tangent_lse)
//   t_out = (W V + P tV) - t_lse O      with O the forward's output tile, staged in tQ's shared buffer
// and t_out / t_lse leave through the forward's epilogue (fwd_epilogue_sm80: 16-byte row stores, rows past Sq never
// stored).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/fast_math.cuh"
#include "kernels/sm80/fwd_epilogue.cuh"
#include "kernels/sm80/fwd_mainloop.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"

namespace flashjax::sm80 {

// The thread's rows' t_lse from its share of rowsum(W) (quad-reduced here). sink_log2: the head's sink logit in log2
// units (-inf without sinks, then t_sink is 0). Empty and padding rows (lse_log2 = +inf) get 0. P_sink is at most 1
// (the sink is one term of the denominator lse sums); the clamp keeps the +inf sink's stand-in (api.py's 1e30 logit,
// whose lse is rounded at 1e30's magnitude) from forming exp(+big) * t_sink: its P_sink is 1 and its t_sink 0.
template <int kRows>
__device__ __forceinline__ void tangent_lse(const float (&w_sum)[kRows], const float (&lse_log2)[kRows],
                                            float sink_log2, float t_sink, float (&t_lse)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float p_sink =
        lse_log2[r] == INFINITY ? 0.f : fminf(common::exp2_ftz(sink_log2 - lse_log2[r]), 1.f);
    t_lse[r] = common::quad_allreduce(w_sum[r], common::SumOp{}) + p_sink * t_sink;
  }
}

// acc_o (W V + P tV) becomes t_out = acc_o - t_lse O and is stored with t_lse. g_o: the forward's (kBlockM, D) output
// tile; g_t_out its tangent's; t_lse_tile: &t_lse[b, h, m_start]. Q's and tQ's shared buffers must be free and no
// cp.async pending (tangent_mainloop_sm80's state on return).
template <typename Layouts, typename AccO, typename GO, typename GTO>
__device__ __forceinline__ void tangent_epilogue_sm80(AccO& acc_o, const float (&t_lse)[Layouts::kRowsPerThread],
                                                      const GO& g_o, GTO& g_t_out, float* t_lse_tile, int rows_valid,
                                                      typename Layouts::Element* smem) {
  using namespace cute;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kHeadDim = Layouts::kHeadDim;
  const int tid = threadIdx.x;

  // O -> tQ's buffer (rows past Sq zero-filled, never read from global).
  Tensor s_o = make_tensor(make_smem_ptr(smem + Layouts::kOffsetTq), typename Layouts::SmemLayoutQ{});
  typename Layouts::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tid);
  copy_rows_zero_fill<true>(gmem_copy, gmem_thr_copy.partition_S(g_o), gmem_thr_copy.partition_D(s_o),
                            gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})),
                            rows_valid);
  cute::cp_async_fence();
  cute::cp_async_wait<0>();
  __syncthreads();

  // Each accumulator element reads its own (row, col) of O: the smem tensor indexes through the swizzle.
  typename Layouts::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor acc_rc = common::acc_rowcol_view(acc_o);
  Tensor coords_rc =
      common::acc_rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(acc_rc); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(acc_rc); ++c) {
      const auto coord = coords_rc(r, c);
      acc_rc(r, c) -= t_lse[r] * static_cast<float>(s_o(get<0>(coord), get<1>(coord)));
    }
  }
  // fwd_epilogue_sm80 stages t_out through Q's buffer, which no thread reads any more.
  fwd_epilogue_sm80<Layouts>(acc_o, t_lse, g_t_out, t_lse_tile, rows_valid, smem);
}

}  // namespace flashjax::sm80

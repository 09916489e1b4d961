// Epilogue of the sm90 fused jvp kernel, per consumer warpgroup (64 rows): the forward's finalize with the tangent's
// row terms, then the stores. With m the rows' max, Z and C their sums (jvp_mainloop.cuh) and the sink joined at a
// common maximum M = max(m, sink) (common::OnlineSoftmax::finalize's rule, so a sink far above the scores cannot
// overflow):
//   denominator = Z e^(m - M) + e^(sink - M),   out = O e^(m - M) / denominator,   lse = M + log(denominator)
//   t_lse = (C e^(m - M) + e^(sink - M) t_sink) / denominator,   t_out = tO e^(m - M) / denominator - t_lse out
// (C / Z is the P-weighted mean of tS, the tangent of the log-sum-exp; t_out is the tangent of O / Z.) out and lse are
// what the forward writes (FwdEpilogueSm90: same finalize, same layouts); t_out, t_lse what the tangent writes, up to
// rounding: t_out is formed from the f32 out, not the stored 16-bit one. Empty rows: without a sink out = 0,
// lse = -inf, t_out = 0, t_lse = 0; with one out = 0, lse = sink, t_lse = t_sink (the tangent kernel's conventions).
//
// out and t_out are staged in the warpgroup's Q and tQ halves (free once its last wgmma was waited on: the mainloop's
// state on return; never loaded on a tile without blocks, whose accumulators are zero), written by stmatrix and
// stored by one TMA store each; TMA drops rows past Sq. lse and t_lse go out per row from the lane holding column 0.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashjax/params.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/sm90/jvp_mainloop.cuh"
#include "kernels/sm90/tangent_epilogue.cuh"
#include "kernels/sm90/tangent_named_barriers.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

template <typename Mainloop>
struct JvpEpilogueSm90 : TangentEpilogueBase<Mainloop> {
  using Base = TangentEpilogueBase<Mainloop>;
  using typename Base::Element;
  using typename Base::WgRows;
  using typename Base::HeadDim;
  using typename Base::SmemLayoutO;
  using typename Base::TmaStoreO;
  using Base::kConsumerWarpgroups;
  using Base::kRowsPerWarpgroup;
  // stmatrix: the forward's staging copy (fwd_epilogue.cuh), 16-byte rows of 8x8 tiles without bank conflicts.
  using SmemCopyAtomO = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  using Params = typename Base::template ParamsOf<TmaStoreO, float>;  // the jvp writes out and lse

  static Params to_params(const JvpParams& p) { return Base::template params_of<Params>(p, Base::tma_store_o(p, p.o)); }

  // acc_o, acc_t: O and tO (64 x D, this thread's part, relative to stats' row max; zero on a tile without blocks);
  // smem_q_half, smem_tq_half: the warpgroup's Q and tQ halves (free).
  template <typename AccO>
  __device__ static void store(const Params& params, AccO& acc_o, AccO& acc_t, const JvpRowStats& stats,
                               Element* smem_q_half, Element* smem_tq_half, int warpgroup, int thread_in_wg,
                               int m_block, int head_q, int batch) {
    using namespace cute;
    const bool has_sinks = params.sinks != nullptr;
    const float sink_log2 = has_sinks ? params.sinks[head_q] * common::kLog2e : -INFINITY;
    const float t_sink = has_sinks ? params.tsinks[head_q] : 0.f;
    float out_scale[2], lse[2], t_lse[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float z = common::quad_allreduce(stats.row_sum[r], common::SumOp{});
      const float c = common::quad_allreduce(stats.tangent_sum[r], common::SumOp{});
      const float scores_max = stats.row_max[r] == -INFINITY ? -INFINITY : stats.row_max[r] * stats.exp2_scale;
      const float common_max = fmaxf(scores_max, sink_log2);
      out_scale[r] = 0.f;
      lse[r] = -INFINITY;
      t_lse[r] = 0.f;
      if (common_max != -INFINITY) {
        // The forward's approximate forms (OnlineSoftmax::finalize): exponents <= 0, denominator >= 1 (its largest
        // term is exp2(0)), so the fast division is exact enough.
        const float scores_weight = common::exp2_ftz(scores_max - common_max);
        const float sink_weight = common::exp2_ftz(sink_log2 - common_max);
        const float denominator = z * scores_weight + sink_weight;
        out_scale[r] = __fdividef(scores_weight, denominator);
        lse[r] = (common_max + common::log2_approx(denominator)) * common::kLn2;
        // No sink: sink_weight = 0 and t_sink = 0, so the product is 0.
        t_lse[r] = c * out_scale[r] + __fdividef(sink_weight, denominator) * t_sink;
      }
    }
    Tensor o_rc = common::wgmma_acc_rowcol_view(acc_o);
    Tensor t_rc = common::wgmma_acc_rowcol_view(acc_t);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(o_rc); ++r) {
      CUTE_UNROLL
      for (int col = 0; col < size<1>(o_rc); ++col) {
        const float out = o_rc(r, col) * out_scale[r];
        o_rc(r, col) = out;
        t_rc(r, col) = t_rc(r, col) * out_scale[r] - t_lse[r] * out;
      }
    }

    typename Mainloop::TiledMmaPV mma_pv;
    Tensor s_o = make_tensor(make_smem_ptr(smem_q_half), SmemLayoutO{});
    Tensor s_t = make_tensor(make_smem_ptr(smem_tq_half), SmemLayoutO{});
    Tensor r_o = make_tensor<Element>(acc_o.layout());
    Tensor r_t = make_tensor<Element>(acc_t.layout());
    common::convert_fragment_into(acc_o, r_o);
    common::convert_fragment_into(acc_t, r_t);
    // Every warp of the warpgroup is past its last wgmma wait (the mainloop's) before the halves are overwritten.
    cutlass::arch::NamedBarrier::sync(128, TangentNamedBarrier::epilogue(warpgroup));
    auto smem_copy = make_tiled_copy_C(SmemCopyAtomO{}, mma_pv);
    auto thr_copy = smem_copy.get_thread_slice(thread_in_wg);
    copy(smem_copy, thr_copy.retile_S(r_o), thr_copy.partition_D(s_o));
    copy(smem_copy, thr_copy.retile_S(r_t), thr_copy.partition_D(s_t));
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes before the async-proxy (TMA) reads
    cutlass::arch::NamedBarrier::sync(128, TangentNamedBarrier::epilogue(warpgroup));
    const int half = m_block * kConsumerWarpgroups + warpgroup;
    if (thread_in_wg == 0) {
      Base::store_half(params.tma_o, params.shape_o, s_o, half, head_q, batch);
      Base::store_half(params.tma_t_out, params.shape_o, s_t, half, head_q, batch);
      tma_store_arrive();
    }

    Tensor coords_rc =
        common::wgmma_acc_rowcol_view(mma_pv.get_thread_slice(thread_in_wg).partition_C(
            make_identity_tensor(Shape<WgRows, HeadDim>{})));
    if (get<1>(coords_rc(0, 0)) == 0) {
      const int seqlen_q = get<0>(params.shape_o);
      const int64_t offset = batch * params.lse_batch_stride + head_q * params.lse_head_stride;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = half * kRowsPerWarpgroup + get<0>(coords_rc(r, 0));
        if (row < seqlen_q) {
          params.lse[offset + row] = lse[r];
          params.t_lse[offset + row] = t_lse[r];
        }
      }
    }
    // The stores must have read shared memory before the CTA exits.
    if (thread_in_wg == 0) tma_store_wait<0>();
  }
};

}  // namespace flashjax::sm90

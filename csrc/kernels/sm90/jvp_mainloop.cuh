// Mainloop of the sm90 fused jvp kernel (issue 39): the forward and its tangent in one sweep over the key blocks, S
// computed once. Per key block, with m the running row max (log2 domain, the forward's online softmax) and
// ds = d(score) / d(q.k) (scale, times 1 - tanh^2 under softcap):
//   S = Q K^T,  tS = tQ K^T + Q tK^T  (raw; scaled by ds below),   P = exp2(s - m),  W = P * tS * ds
//   Z += rowsum(P),  C += rowsum(W),  O += P V,  tO += W V + P tV
// with Z, C, O and tO multiplied by exp2(m_old - m_new) whenever m moves. The epilogue (jvp_epilogue.cuh) divides by Z
// (with the sink's term) and forms lse, t_lse = C / Z (+ the sink's tangent term) and t_out = tO / Z - t_lse out.
// That is 3 score GEMMs and 3 PV GEMMs per block (6 GEMM units) where the forward + tangent pair runs 2 + 5.
//
// The producer side, the shared memory, the score GEMMs, the ping-pong turns and the key loop (run_blocks) are the
// tangent mainloop's (tangent_mainloop.cuh): it loads exactly the tensors this kernel reads. What differs is the
// consumer's step:
//   block 0      issue S_0, tS_0; wait; release the K stage; softmax -> P_0, W_0 (nothing to rescale yet)
//   step t >= 1  issue S_t, tS_t and O += P_{t-1} V_{t-1}, tO += W_{t-1} V_{t-1} + P_{t-1} tV_{t-1}; wait for the
//                scores only, release their K stage, fold block t into (m, Z, C) and form P_t, W_t while the PV
//                GEMMs run; wait for those, release the V stage, rescale O and tO by the block's correction
//   tail         issue the last PV GEMMs; wait; release the V stage
// (the forward's intra-warpgroup overlap: the correction is computed before O is ours again, applied after.)
// Rows past Sq and keys past Sk are TMA's zero fill: finite scores (never stored: rows; masked by the band bounded
// by Sk: keys) and zero V / tV rows.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/online_softmax.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/tangent_mainloop.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

// Per thread, its two rows' running statistics: the forward's (row max, Z = row_sum) plus C, the rows' running sum of
// W = P * tS * ds relative to the same max. All three are this thread's share of the row (quad-reduced once, in the
// epilogue); row_max is quad-reduced already (OnlineSoftmax::running_row_max).
struct JvpRowStats : common::OnlineSoftmax<2> {
  float tangent_sum[2];
  __device__ __forceinline__ explicit JvpRowStats(float exp2_scale_) : common::OnlineSoftmax<2>(exp2_scale_) {
    tangent_sum[0] = tangent_sum[1] = 0.f;
  }
};

template <typename Element_, int kHeadDim_, int kBlockN_, int kStagesK_, int kStagesV_, bool kSoftcap_>
struct JvpMainloopSm90 : TangentMainloopSm90<Element_, kHeadDim_, kBlockN_, kStagesK_, kStagesV_, kSoftcap_> {
  using Base = TangentMainloopSm90<Element_, kHeadDim_, kBlockN_, kStagesK_, kStagesV_, kSoftcap_>;
  using typename Base::Consumer;
  using typename Base::Element;
  using typename Base::PipelineK;
  using typename Base::PipelineV;
  using typename Base::TensorStorage;
  using typename Base::BarrierStorage;
  using typename Base::WgRows;
  using typename Base::BlockN;
  using Base::kBlockN;
  using Base::kSoftcap;

  // One block's raw scores -> P and W in place (s_rc, ts_rc: (row, col) views), folded into the row statistics.
  // Softcap, then the band mask (kMasked), as the forward orders them (fwd_softmax.cuh). correction[r]: what O, tO
  // of row r must be multiplied by to be relative to the new max (applied by the caller once the PV GEMMs reading
  // them are done). A row with no visible key so far keeps max -inf and base 0 (OnlineSoftmax): P = 0, never NaN.
  // Masked scores are -inf: P = 0, and the clamp makes tanh' of -inf 0, so W = 0 * 0, not 0 * inf.
  template <bool kMasked, typename ScoresRC, typename CoordsRC, typename Mask>
  __device__ __forceinline__ static void fold_block(ScoresRC& s_rc, ScoresRC& ts_rc, const CoordsRC& coords_rc,
                                                    const Mask& mask, int n_start,
                                                    const common::ScoreTransform& transform, float softmax_scale,
                                                    JvpRowStats& stats, float (&correction)[2]) {
    using namespace cute;
    if constexpr (kSoftcap) transform.apply_softcap(s_rc);
    if constexpr (kMasked) mask.apply(s_rc, coords_rc, n_start);
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      const float base = stats.fold_row_max(s_rc, mi, correction[mi]);
      float p_sum = 0.f;
      float w_sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s_rc); ++ni) {
        const float s = s_rc(mi, ni);
        const float p = common::exp2_ftz(fmaf(s, stats.exp2_scale, -base));
        const float ds = kSoftcap ? softmax_scale * fmaxf(1.f - s * s, 0.f) : softmax_scale;
        const float w = p * (ts_rc(mi, ni) * ds);
        s_rc(mi, ni) = p;
        ts_rc(mi, ni) = w;
        p_sum += p;
        w_sum += w;
      }
      stats.row_sum[mi] = stats.row_sum[mi] * correction[mi] + p_sum;
      stats.tangent_sum[mi] = stats.tangent_sum[mi] * correction[mi] + w_sum;
    }
  }

  // O += P V, tO += W V + P tV of the next (V, tV) stage, P and W in registers: three wgmma batches, left in flight.
  template <typename TV, typename AccO>
  __device__ __forceinline__ static void issue_pv(Consumer& c, PipelineV& pipeline_v, TV& tOrV, TV& tOrTv,
                                                  AccO& acc_o, AccO& acc_t) {
    using namespace cute;
    pipeline_v.consumer_wait(c.read_v);
    const int stage = c.read_v.index();
    common::wgmma_gemm<false, -1>(c.mma_pv, c.p, tOrV(_, _, _, stage), acc_o);
    common::wgmma_gemm<false, -1>(c.mma_pv, c.w, tOrV(_, _, _, stage), acc_t);
    common::wgmma_gemm<false, -1>(c.mma_pv, c.p, tOrTv(_, _, _, stage), acc_t);
  }

  // S_t, tS_t have been waited on: release their K stage and fold the block in (P_t, W_t in fp32 in c.s, c.ts).
  template <bool kMasked, typename CoordsRC, typename Mask>
  __device__ __forceinline__ static void scores_done(Consumer& c, PipelineK& pipeline_k, const CoordsRC& coords_rc,
                                                     const Mask& mask, int n_block,
                                                     const common::ScoreTransform& transform, float softmax_scale,
                                                     JvpRowStats& stats, float (&correction)[2]) {
    using namespace cute;
    Base::release_k_stage(c, pipeline_k);
    Tensor s_rc = common::wgmma_acc_rowcol_view(c.s);
    Tensor ts_rc = common::wgmma_acc_rowcol_view(c.ts);
    fold_block<kMasked>(s_rc, ts_rc, coords_rc, mask, n_block * kBlockN, transform, softmax_scale, stats,
                        correction);
  }

  template <typename AccO>
  __device__ __forceinline__ static void rescale(AccO& acc, const float (&correction)[2]) {
    using namespace cute;
    Tensor acc_rc = common::wgmma_acc_rowcol_view(acc);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      CUTE_UNROLL
      for (int col = 0; col < size<1>(acc_rc); ++col) acc_rc(r, col) *= correction[r];
    }
  }

  // Step t >= 1 (see the top of the file). Nothing is in flight across the loop's back edge (the tangent's reason:
  // ptxas serializes every wgmma otherwise).
  template <bool kMasked, typename TK, typename TV, typename CoordsRC, typename Mask, typename AccO>
  __device__ __forceinline__ static void step(Consumer& c, PipelineK& pipeline_k, PipelineV& pipeline_v, Element* q,
                                              Element* tq, int warpgroup, TK& tSrK, TK& tSrTk, TV& tOrV, TV& tOrTv,
                                              const CoordsRC& coords_rc, const Mask& mask, int n_block,
                                              const common::ScoreTransform& transform, float softmax_scale,
                                              JvpRowStats& stats, AccO& acc_o, AccO& acc_t) {
    Base::take_turn(warpgroup);
    Base::issue_scores(c, pipeline_k, q, tq, warpgroup, tSrK, tSrTk);
    issue_pv(c, pipeline_v, tOrV, tOrTv, acc_o, acc_t);
    Base::pass_turn(warpgroup);
    cute::warpgroup_wait<3>();  // the three score batches are complete; the three PV batches may still run
    float correction[2];
    scores_done<kMasked>(c, pipeline_k, coords_rc, mask, n_block, transform, softmax_scale, stats, correction);
    Base::wait_for_pv(c, pipeline_v, acc_o, acc_t);
    rescale(acc_o, correction);
    rescale(acc_t, correction);
    common::convert_fragment_into(c.s, c.p);
    common::convert_fragment_into(c.ts, c.w);
  }

  // The jvp's state for Base::run_blocks: stats (the rows' running max and sums), acc_o and acc_t (O and tO).
  template <typename CoordsRC, typename Mask, typename AccO>
  __device__ __forceinline__ static void first_block_done(Consumer& c, PipelineK& pipeline_k,
                                                          const CoordsRC& coords_rc, const Mask& mask, int n_block,
                                                          const common::ScoreTransform& transform,
                                                          float softmax_scale, JvpRowStats& stats, AccO&, AccO&) {
    // O and tO are still zero: the correction (0 from a max of -inf) needs no applying.
    float correction[2];
    scores_done<true>(c, pipeline_k, coords_rc, mask, n_block, transform, softmax_scale, stats, correction);
  }
  template <typename TV, typename AccO>
  __device__ __forceinline__ static void last_pv(Consumer& c, PipelineV& pipeline_v, TV& tOrV, TV& tOrTv,
                                                 JvpRowStats&, AccO& acc_o, AccO& acc_t) {
    issue_pv(c, pipeline_v, tOrV, tOrTv, acc_o, acc_t);
  }
  template <typename AccO>
  __device__ __forceinline__ static void wait_for_last_pv(Consumer& c, PipelineV& pipeline_v, JvpRowStats&,
                                                          AccO& acc_o, AccO& acc_t) {
    Base::wait_for_pv(c, pipeline_v, acc_o, acc_t);
  }

  // The whole key loop of one warpgroup (blocks not empty): the tangent's (Base::run_blocks) with this mainloop's
  // steps. acc_o, acc_t must be cleared. On return they hold O, tO relative to stats' row max.
  template <typename AccO, typename Mask>
  __device__ __forceinline__ static void run(TensorStorage& tensors, BarrierStorage& barriers, PipelineK& pipeline_k,
                                             PipelineV& pipeline_v, const common::KvBlockRange& blocks,
                                             const Mask& mask, int warpgroup, int thread_in_wg,
                                             const common::ScoreTransform& transform, float softmax_scale,
                                             JvpRowStats& stats, AccO& acc_o, AccO& acc_t) {
    Base::template run_blocks<JvpMainloopSm90>(tensors, barriers, pipeline_k, pipeline_v, blocks, mask, warpgroup,
                                               thread_in_wg, transform, softmax_scale, stats, acc_o, acc_t);
  }
};

}  // namespace flashjax::sm90

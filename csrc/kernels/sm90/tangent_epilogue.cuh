// Epilogue of the sm90 tangent kernel, per consumer warpgroup (64 rows): the row terms of the tangent, then the
// store (the sm80 tangent's math: sm80/tangent_epilogue.cuh):
//   t_lse = rowsum(W) + P_sink t_sink,  P_sink = exp(sink - lse) clamped to [0, 1]
//   t_out = (W V + P tV) - t_lse O
// O's 64-row half arrives by TMA into the warpgroup's own Q half (free once its last wgmma was waited on: the
// mainloop's state on return; never loaded at all on a tile without blocks), each thread replaces its accumulator
// elements' O by t_out in place (the same (row, col) it read: no thread reads another's), and one TMA store writes
// the half out. TMA zero-fills O rows past Sq on the load and drops them on the store, so ragged tiles need no path
// of their own. t_lse goes out per row from the lane holding column 0.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashjax/params.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/sm90/tangent_named_barriers.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

// What the tangent's epilogue and the fused jvp's (jvp_epilogue.cuh) share: each consumer warpgroup stages a 64-row
// half of t_out (the jvp's: and of out) in its own Q half, whose shape and swizzle it has, and one thread writes it
// out in o's layout with a TMA store; both read o's shape and strides from the call (TangentParams or JvpParams).
template <typename Mainloop>
struct TangentEpilogueBase {
  using Element = typename Mainloop::Element;
  using WgRows = typename Mainloop::WgRows;
  using HeadDim = typename Mainloop::HeadDim;
  using ShapeSDHB = typename Mainloop::ShapeSDHB;
  using SmemLayoutO = typename Mainloop::SmemLayoutQHalf;
  static constexpr int kConsumerWarpgroups = Mainloop::kConsumerWarpgroups;
  static constexpr int kRowsPerWarpgroup = Mainloop::kRowsPerWarpgroup;

  using GmemTensorOOut = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeSDHB{},
                                                    typename Mainloop::StrideSDHB{}));
  using TmaStoreO = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorOOut{}, SmemLayoutO{},
                                                 cute::Shape<WgRows, HeadDim>{}, cute::_1{}));

  template <typename CallParams>
  static ShapeSDHB shape_o(const CallParams& p) {  // (Sq, D, Hq, B)
    return {p.seqlen_q, Mainloop::kHeadDim, p.heads_q, p.batch};
  }
  template <typename CallParams>
  static typename Mainloop::StrideSDHB stride_o(const CallParams& p) {
    return {p.o_row_stride, cute::_1{}, p.o_head_stride, p.o_batch_stride};
  }
  // The store of o-shaped halves at `ptr` (t_out, the jvp's out).
  template <typename CallParams>
  static TmaStoreO tma_store_o(const CallParams& p, void* ptr) {
    using namespace cute;
    Tensor m = make_tensor(make_gmem_ptr(static_cast<Element*>(ptr)), shape_o(p), stride_o(p));
    return make_tma_copy(SM90_TMA_STORE{}, m, SmemLayoutO{}, Shape<WgRows, HeadDim>{}, _1{});
  }

  // Both epilogues' parameters, but for o's TMA (TmaO: the tangent loads the forward's o, the jvp stores its own)
  // and lse's constness (Lse: the tangent reads lse, the jvp writes it); params_of fills them from the call.
  template <typename TmaO, typename Lse>
  struct ParamsOf {
    TmaO tma_o;
    TmaStoreO tma_t_out;  // o's layout
    ShapeSDHB shape_o;    // (Sq, D, Hq, B)
    Lse* lse;             // [B, Hq, Sq] (row stride 1); t_lse has the same layout
    float* t_lse;
    int64_t lse_batch_stride, lse_head_stride;
    const float* sinks;   // [Hq] or nullptr; tsinks is given exactly when sinks is
    const float* tsinks;
  };
  template <typename Params, typename CallParams, typename TmaO>
  static Params params_of(const CallParams& p, const TmaO& tma_o) {
    return {tma_o, tma_store_o(p, p.t_out), shape_o(p), p.lse, p.t_lse, p.lse_batch_stride, p.lse_head_stride,
            p.sinks, p.tsinks};
  }

  // Params: the epilogue's, whose tma_o (a load or a store) and tma_t_out both kernels' producers prefetch.
  template <typename Params>
  __device__ static void prefetch_tma_descriptors(const Params& params) {
    cute::prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_t_out.get_tma_descriptor());
  }

  // Writes the staged half s_half (rows 64 half .. 64 half + 63 of (head_q, batch)) out; one thread issues it.
  template <typename SmemHalf>
  __device__ __forceinline__ static void store_half(const TmaStoreO& tma, const ShapeSDHB& shape,
                                                    const SmemHalf& s_half, int half, int head_q, int batch) {
    using namespace cute;
    Tensor g = local_tile(tma.get_tma_tensor(shape)(_, _, head_q, batch), Shape<WgRows, HeadDim>{},
                          make_coord(half, _0{}));
    auto slice = tma.get_slice(_0{});
    copy(tma, slice.partition_S(s_half), slice.partition_D(g));
  }
};

template <typename Mainloop>
struct TangentEpilogueSm90 : TangentEpilogueBase<Mainloop> {
  using Base = TangentEpilogueBase<Mainloop>;
  using typename Base::Element;
  using typename Base::WgRows;
  using typename Base::HeadDim;
  using typename Base::SmemLayoutO;
  using typename Base::TmaStoreO;
  using Base::kConsumerWarpgroups;
  using Base::kRowsPerWarpgroup;
  static constexpr uint32_t kTmaBytesOHalf = kRowsPerWarpgroup * Mainloop::kHeadDim * sizeof(Element);
  using TmaLoadO = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, typename Mainloop::GmemTensorQK{}, SmemLayoutO{},
                                                cute::Shape<WgRows, HeadDim>{}, cute::_1{}));

  using Params = typename Base::template ParamsOf<TmaLoadO, const float>;  // tma_o: the forward's output

  static Params to_params(const TangentParams& p) {
    using namespace cute;
    Tensor m_o =
        make_tensor(make_gmem_ptr(static_cast<const Element*>(p.o)), Base::shape_o(p), Base::stride_o(p));
    return Base::template params_of<Params>(
        p, make_tma_copy(SM90_TMA_LOAD{}, m_o, SmemLayoutO{}, Shape<WgRows, HeadDim>{}, _1{}));
  }

  // The thread's rows' forward lse in log2 units; +inf where the forward found no visible key (lse = -inf) and on
  // rows past Sq, so that their P is 0 and their t_lse 0. rows: warpgroup-local (Mainloop::thread_rows).
  __device__ static void lse_log2_of_rows(const Params& params, const int (&rows)[2], int m_block, int warpgroup,
                                          int head_q, int batch, float (&lse_log2)[2]) {
    const int seqlen_q = cute::get<0>(params.shape_o);
    const float* lse_rows = params.lse + batch * params.lse_batch_stride + head_q * params.lse_head_stride;
    const int row_start = (m_block * kConsumerWarpgroups + warpgroup) * kRowsPerWarpgroup;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = row_start + rows[r];
      const float lse = row < seqlen_q ? lse_rows[row] : -INFINITY;
      lse_log2[r] = lse == -INFINITY ? INFINITY : lse * common::kLog2e;
    }
  }

  // acc: W V + P tV (64 x D, this thread's part; zero for a tile without blocks); w_sum: this thread's share of its
  // rows' sums of W; smem_q_half: the warpgroup's Q half (free); barrier_o: the warpgroup's, used once.
  template <typename AccO>
  __device__ static void store(const Params& params, AccO& acc, const float (&w_sum)[2], const float (&lse_log2)[2],
                               Element* smem_q_half, cutlass::arch::ClusterTransactionBarrier& barrier_o,
                               int warpgroup, int thread_in_wg, int m_block, int head_q, int batch) {
    using namespace cute;
    Tensor s_o = make_tensor(make_smem_ptr(smem_q_half), SmemLayoutO{});
    const int half = m_block * kConsumerWarpgroups + warpgroup;
    // Every warp of the warpgroup is past its last wgmma wait (the mainloop's) before TMA overwrites the Q half.
    cutlass::arch::NamedBarrier::sync(128, TangentNamedBarrier::epilogue(warpgroup));
    if (thread_in_wg == 0) {
      barrier_o.arrive_and_expect_tx(kTmaBytesOHalf);
      Tensor g_o = local_tile(params.tma_o.get_tma_tensor(params.shape_o)(_, _, head_q, batch),
                              Shape<WgRows, HeadDim>{}, make_coord(half, _0{}));
      auto tma = params.tma_o.get_slice(_0{});
      copy(params.tma_o.with(reinterpret_cast<uint64_t&>(barrier_o), 0, TMA::CacheHintSm90::EVICT_FIRST),
           tma.partition_S(g_o), tma.partition_D(s_o));
    }

    // t_lse while O is in flight.
    const bool has_sinks = params.sinks != nullptr;
    const float sink_log2 = has_sinks ? params.sinks[head_q] * common::kLog2e : -INFINITY;
    const float t_sink = has_sinks ? params.tsinks[head_q] : 0.f;
    float t_lse[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      // P_sink <= 1 (the sink is one term of the sum lse is the log of); the clamp keeps api.py's 1e30 stand-in for
      // a +inf sink (whose lse rounds at that magnitude) from forming exp(+big) * t_sink (its t_sink is 0).
      const float p_sink = lse_log2[r] == INFINITY ? 0.f : fminf(common::exp2_ftz(sink_log2 - lse_log2[r]), 1.f);
      t_lse[r] = common::quad_allreduce(w_sum[r], common::SumOp{}) + p_sink * t_sink;
    }

    typename Mainloop::TiledMmaPV mma_pv;
    auto thr_mma = mma_pv.get_thread_slice(thread_in_wg);
    Tensor coords_rc =
        common::wgmma_acc_rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<WgRows, HeadDim>{})));
    Tensor acc_rc = common::wgmma_acc_rowcol_view(acc);
    barrier_o.wait(0);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(acc_rc); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_rc); ++c) {
        const int row = get<0>(coords_rc(r, c));
        const int col = get<1>(coords_rc(r, c));
        const float o = static_cast<float>(s_o(row, col));
        s_o(row, col) = static_cast<Element>(acc_rc(r, c) - t_lse[r] * o);
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes before the async-proxy (TMA) read
    cutlass::arch::NamedBarrier::sync(128, TangentNamedBarrier::epilogue(warpgroup));
    if (thread_in_wg == 0) {
      Base::store_half(params.tma_t_out, params.shape_o, s_o, half, head_q, batch);
      tma_store_arrive();
    }

    if (get<1>(coords_rc(0, 0)) == 0) {
      const int seqlen_q = get<0>(params.shape_o);
      float* t_lse_rows = params.t_lse + batch * params.lse_batch_stride + head_q * params.lse_head_stride;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = half * kRowsPerWarpgroup + get<0>(coords_rc(r, 0));
        if (row < seqlen_q) t_lse_rows[row] = t_lse[r];
      }
    }
    // The store must have read shared memory before the CTA exits.
    if (thread_in_wg == 0) tma_store_wait<0>();
  }
};

}  // namespace flashjax::sm90

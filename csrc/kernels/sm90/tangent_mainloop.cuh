// Mainloop of the sm90 tangent kernel (forward-mode derivative of attention, issue 39): the producer warps' TMA loads
// and the consumer warpgroups' wgmma GEMMs. The math is the sm80 tangent's (sm80/tangent_mainloop.cuh): with the
// forward's lse L known, P = exp(s - L) is exact per block, and one sweep over the key blocks accumulates
//   w_sum = rowsum(W),  acc = W V + P tV,   W = P * tS * ds,  tS = tq K^T + q tK^T,  ds = ds_true / d(q.k)
// (scale, times 1 - tanh^2 under softcap); the epilogue (tangent_epilogue.cuh) forms t_lse and t_out = acc - t_lse O.
//
// Data flow per CTA (one 128-row tile; consumer warpgroup w owns rows 64w .. 64w + 63):
//   Q, tQ:  one TMA box per 64-row half each, all completing on one mbarrier (loaded once: the CTA has one tile);
//   K, tK:  a kStagesK-deep ring (cutlass::PipelineTmaAsync), both tiles of a block in one stage, fed by producer
//           warp 0;
//   V, tV:  a kStagesV-deep ring fed by producer warp 1 (two warps, so that neither ring's loads queue behind the
//           other's stage releases, as in the forward: fwd_mainloop.cuh).
// Consumer steps (block b(t) = blocks.block_at(t), masked blocks first as in the forward):
//   block 0      issue S_0 = Q K^T, tS_0 = tQ K^T + Q tK^T (SS); wait; release the K stage; P_0, W_0 in registers
//   step t >= 1  issue S_t, tS_t and acc += W_{t-1} V_{t-1} + P_{t-1} tV_{t-1} (RS); wait for the scores only,
//                release their K stage and form P_t, W_t while the PV GEMMs run; wait for those, release the V stage
//   tail         issue acc += W_{n-1} V_{n-1} + P_{n-1} tV_{n-1}; wait; release the V stage
// Each issue happens on the warpgroup's ping-pong turn, so that one warpgroup's P / W work overlaps the other's
// GEMMs. Rows past Sq and keys past Sk are TMA's zero fill: finite scores, hidden by lse = +inf (rows) and the band
// mask (keys, bounded by Sk), and zero V / tV rows, so 0 * V is 0, never NaN.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/mainloop_types.cuh"
#include "kernels/sm90/tangent_named_barriers.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStagesK_, int kStagesV_, bool kSoftcap_>
struct TangentMainloopSm90 : MainloopTypesSm90<Element_, kHeadDim_, kBlockN_, kStagesK_, kStagesV_> {
  // The forward's GEMMs, shared layouts, stage rings and TMA types: mainloop_types.cuh.
  using Types = MainloopTypesSm90<Element_, kHeadDim_, kBlockN_, kStagesK_, kStagesV_>;
  using typename Types::Element;
  using Types::kHeadDim;
  using Types::kBlockN;
  using Types::kStagesK;
  using Types::kStagesV;
  using Types::kRowsPerWarpgroup;
  using typename Types::HeadDim;
  using typename Types::BlockN;
  using typename Types::WgRows;
  using typename Types::TiledMmaQK;
  using typename Types::TiledMmaPV;
  using typename Types::SmemLayoutQHalf;
  using typename Types::SmemLayoutK;
  using typename Types::SmemLayoutVt;
  using Types::kQHalfElems;
  using typename Types::PipelineK;
  using typename Types::PipelineV;
  using typename Types::StateK;
  using typename Types::StateV;
  using typename Types::ShapeSDHB;
  using typename Types::StrideSDHB;
  using typename Types::TmaQ;
  using typename Types::TmaK;
  using typename Types::TmaVt;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockM = kRowsPerWarpgroup * kConsumerWarpgroups;
  static_assert(kBlockN % 16 == 0, "kBlockN is the K of acc += P V: a multiple of 16");

  static constexpr int kQElems = kConsumerWarpgroups * kQHalfElems;

  // A Q half doubles as its warpgroup's staging buffer of O and then t_out in the epilogue (same shape and swizzle).
  struct TensorStorage {
    cute::array_aligned<Element, kQElems, 1024> q;
    cute::array_aligned<Element, kQElems, 1024> tq;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> tk;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> tv;
  };

  struct BarrierStorage {
    typename PipelineK::SharedStorage k;
    typename PipelineV::SharedStorage v;
    cutlass::arch::ClusterTransactionBarrier q;                         // Q and tQ landed
    cutlass::arch::ClusterTransactionBarrier o[kConsumerWarpgroups];    // the epilogue's O half landed
  };

  // The global tensors are the forward's; a tangent has its primal's strides (params.h). kTmaBytesKV (the base's)
  // counts one of K, tK, V, tV.
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);  // one of Q, tQ

  struct Arguments {
    const Element *q, *k, *v, *tq, *tk, *tv;
    ShapeSDHB shape_q;  // (Sq, D, Hq, B)
    ShapeSDHB shape_k;  // (Sk, D, Hk, B), Sk clamped to >= 1 (a TMA dimension cannot be 0)
    StrideSDHB stride_q, stride_k, stride_v;
  };

  struct Params {
    TmaQ tma_q, tma_tq;
    TmaK tma_k, tma_tk;
    TmaVt tma_vt, tma_tvt;
    ShapeSDHB shape_q;
    ShapeSDHB shape_k;
  };

  static Params to_params(const Arguments& args) {
    using namespace cute;
    auto tma_q = [&](const Element* ptr) {
      return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), args.shape_q, args.stride_q),
                           SmemLayoutQHalf{}, Shape<WgRows, HeadDim>{}, _1{});
    };
    auto tma_k = [&](const Element* ptr) {
      return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), args.shape_k, args.stride_k),
                           take<0, 2>(SmemLayoutK{}), Shape<BlockN, HeadDim>{}, _1{});
    };
    auto tma_vt = [&](const Element* ptr) {
      return make_tma_copy(SM90_TMA_LOAD{},
                           make_tensor(make_gmem_ptr(ptr), select<1, 0, 2, 3>(args.shape_k),
                                       select<1, 0, 2, 3>(args.stride_v)),
                           take<0, 2>(SmemLayoutVt{}), Shape<HeadDim, BlockN>{}, _1{});
    };
    return {tma_q(args.q),   tma_q(args.tq),   tma_k(args.k), tma_k(args.tk),
            tma_vt(args.v),  tma_vt(args.tv),  args.shape_q,  args.shape_k};
  }

  __device__ static void prefetch_tma_descriptors(const Params& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_tq.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_tk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_vt.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_tvt.get_tma_descriptor());
  }

  struct LoadCoords {
    int m_block;
    int head_q;
    int head_k;
    int batch;
  };

  // ---- Producer side: warp 0 loads Q, tQ and the (K, tK) stages, warp 1 the (V, tV) stages; one lane (`leader`,
  // the pipeline's is_leader: it also arms each stage's full barrier) issues, the others return at once (the CTA has
  // one tile, so no pipeline state outlives the call). Called only for a tile with blocks.

  // K/V and their tangents are re-read by every query tile of the head (and every query head of a GQA group): kept
  // in L2 (EVICT_LAST); Q and tQ are read by this tile only.
  // Blocks: the band's common::KvBlockRange, or a mask mod's common::ListedKvBlocks (the same interface).
  template <typename Blocks>
  __device__ static void load_q_k(const Params& params, TensorStorage& tensors, BarrierStorage& barriers,
                                  PipelineK& pipeline_k, bool leader, const LoadCoords& at, const Blocks& blocks) {
    using namespace cute;
    if (!leader) return;
    auto& barrier_q = barriers.q;
    barrier_q.arrive_and_expect_tx(2 * kTmaBytesQ);
    auto load_q = [&](const TmaQ& tma, Element* smem) {
      Tensor g = local_tile(tma.get_tma_tensor(params.shape_q)(_, _, at.head_q, at.batch), Shape<WgRows, HeadDim>{},
                            make_coord(_, _0{}));  // (64, D, half-tiles of Sq)
      auto slice = tma.get_slice(_0{});
      Tensor src = group_modes<0, 3>(slice.partition_S(g));
      CUTE_UNROLL
      for (int half = 0; half < kConsumerWarpgroups; ++half) {
        Tensor dst = make_tensor(make_smem_ptr(smem + half * kQHalfElems), SmemLayoutQHalf{});
        copy(tma.with(reinterpret_cast<uint64_t&>(barrier_q), 0, TMA::CacheHintSm90::EVICT_FIRST),
             src(_, at.m_block * kConsumerWarpgroups + half), group_modes<0, 3>(slice.partition_D(dst)));
      }
    };
    load_q(params.tma_q, tensors.q.data());
    load_q(params.tma_tq, tensors.tq.data());

    Tensor s_k = make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutK{});
    Tensor s_tk = make_tensor(make_smem_ptr(tensors.tk.data()), SmemLayoutK{});
    auto tiles_k = [&](const TmaK& tma) {  // (TMA, n_blocks)
      Tensor g = local_tile(tma.get_tma_tensor(params.shape_k)(_, _, at.head_k, at.batch), Shape<BlockN, HeadDim>{},
                            make_coord(_, _0{}));
      return group_modes<0, 3>(tma.get_slice(_0{}).partition_S(g));
    };
    Tensor tKgK = tiles_k(params.tma_k);
    Tensor tKgTk = tiles_k(params.tma_tk);
    Tensor tKsK = group_modes<0, 3>(params.tma_k.get_slice(_0{}).partition_D(s_k));
    Tensor tKsTk = group_modes<0, 3>(params.tma_tk.get_slice(_0{}).partition_D(s_tk));
    auto write = cutlass::make_producer_start_state<PipelineK>();
    for (int t = 0; t < blocks.num_blocks(); ++t) {
      const int n_block = blocks.block_at(t);
      pipeline_k.producer_acquire(write);
      auto* full = pipeline_k.producer_get_barrier(write);
      copy(params.tma_k.with(*full, 0, TMA::CacheHintSm90::EVICT_LAST), tKgK(_, n_block), tKsK(_, write.index()));
      copy(params.tma_tk.with(*full, 0, TMA::CacheHintSm90::EVICT_LAST), tKgTk(_, n_block), tKsTk(_, write.index()));
      ++write;
    }
  }

  template <typename Blocks>
  __device__ static void load_v(const Params& params, TensorStorage& tensors, PipelineV& pipeline_v, bool leader,
                                const LoadCoords& at, const Blocks& blocks) {
    using namespace cute;
    if (!leader) return;
    Tensor s_vt = make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutVt{});
    Tensor s_tvt = make_tensor(make_smem_ptr(tensors.tv.data()), SmemLayoutVt{});
    auto tiles_vt = [&](const TmaVt& tma) {  // (TMA, n_blocks)
      Tensor g = local_tile(tma.get_tma_tensor(select<1, 0, 2, 3>(params.shape_k))(_, _, at.head_k, at.batch),
                            Shape<HeadDim, BlockN>{}, make_coord(_0{}, _));
      return group_modes<0, 3>(tma.get_slice(_0{}).partition_S(g));
    };
    Tensor tVgV = tiles_vt(params.tma_vt);
    Tensor tVgTv = tiles_vt(params.tma_tvt);
    Tensor tVsV = group_modes<0, 3>(params.tma_vt.get_slice(_0{}).partition_D(s_vt));
    Tensor tVsTv = group_modes<0, 3>(params.tma_tvt.get_slice(_0{}).partition_D(s_tvt));
    auto write = cutlass::make_producer_start_state<PipelineV>();
    for (int t = 0; t < blocks.num_blocks(); ++t) {
      const int n_block = blocks.block_at(t);
      pipeline_v.producer_acquire(write);
      auto* full = pipeline_v.producer_get_barrier(write);
      copy(params.tma_vt.with(*full, 0, TMA::CacheHintSm90::EVICT_LAST), tVgV(_, n_block), tVsV(_, write.index()));
      copy(params.tma_tvt.with(*full, 0, TMA::CacheHintSm90::EVICT_LAST), tVgTv(_, n_block),
           tVsTv(_, write.index()));
      ++write;
    }
  }

  // ---- Consumer side, per warpgroup (thread_in_wg in [0, 128)).

  using FragS = decltype(cute::partition_fragment_C(TiledMmaQK{}, cute::Shape<WgRows, BlockN>{}));
  using FragP = decltype(cute::make_tensor<Element>(common::wgmma_acc_as_a_layout(FragS{}.layout())));

  // The warpgroup-local rows (0..63) of this thread's score and accumulator fragments, in the fragments' row order.
  __device__ __forceinline__ static void thread_rows(int thread_in_wg, int (&rows)[2]) {
    using namespace cute;
    Tensor coords_rc = common::wgmma_acc_rowcol_view(
        TiledMmaQK{}.get_thread_slice(thread_in_wg).partition_C(make_identity_tensor(Shape<WgRows, BlockN>{})));
    static_assert(decltype(size<0>(coords_rc))::value == 2, "a thread holds two rows of a 64-row wgmma tile");
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) rows[r] = get<0>(coords_rc(r, 0));
  }

  // One block's scores -> P and W, in (row, col) views: s_rc holds raw q.k, ts_rc raw tq.k + q.tk. Softcap, then the
  // band mask (kMasked: the block needs it) as the forward orders them (fwd_softmax.cuh); then
  //   P = exp2(s * exp2_scale - lse_log2),  W = P * tS * ds  (ds: scale, times 1 - tanh^2 under softcap),
  // written over s_rc and ts_rc, W's row sums added to w_sum. lse_log2 is +inf on empty and padding rows, so P = 0
  // there (never NaN); masked scores give P = 0, and the clamp turns tanh' of a masked -inf into 0, not 0 * -inf.
  template <bool kMasked, typename ScoresRC, typename CoordsRC, typename Mask>
  __device__ __forceinline__ static void probs_and_weights(ScoresRC& s_rc, ScoresRC& ts_rc, const CoordsRC& coords_rc,
                                                           const Mask& mask, int n_start,
                                                           const common::ScoreTransform& transform,
                                                           float softmax_scale, const float (&lse_log2)[2],
                                                           float (&w_sum)[2]) {
    using namespace cute;
    if constexpr (kSoftcap) transform.apply_softcap(s_rc);
    if constexpr (kMasked) mask.apply(s_rc, coords_rc, n_start);
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s_rc); ++ni) {
        const float s = s_rc(mi, ni);
        const float p = common::exp2_ftz(fmaf(s, transform.exp2_scale, -lse_log2[mi]));
        const float ds = kSoftcap ? softmax_scale * fmaxf(1.f - s * s, 0.f) : softmax_scale;
        const float w = p * (ts_rc(mi, ni) * ds);
        s_rc(mi, ni) = p;
        ts_rc(mi, ni) = w;
        w_sum[mi] += w;
      }
    }
  }

  // The warpgroup's view of its Q and tQ halves, the K / tK and V / tV stages, and its GEMMs; and the register
  // state carried from step to step. (Static member functions, not lambdas: nvcc left a lambda holding the step as a
  // called function with a 1 KB stack frame.)
  struct Consumer {
    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    decltype(TiledMmaQK{}.get_thread_slice(0)) thr_qk;
    decltype(TiledMmaPV{}.get_thread_slice(0)) thr_pv;
    StateK read_k;
    StateV read_v;
    FragS s, ts;  // S_t, tS_t, then P_t, W_t in fp32 until converted
    FragP p, w;   // P_t, W_t as A operands of the PV GEMMs
    __device__ __forceinline__ explicit Consumer(int thread_in_wg)
        : thr_qk(mma_qk.get_thread_slice(thread_in_wg)), thr_pv(mma_pv.get_thread_slice(thread_in_wg)) {}
    __device__ __forceinline__ auto q_half(Element* base, int warpgroup) {
      using namespace cute;
      return thr_qk.partition_fragment_A(make_tensor(make_smem_ptr(base + warpgroup * kQHalfElems), SmemLayoutQHalf{}));
    }
    __device__ __forceinline__ auto k_stages(Element* base) {  // (MMA, N, K, stage) descriptors
      using namespace cute;
      return thr_qk.partition_fragment_B(make_tensor(make_smem_ptr(base), SmemLayoutK{}));
    }
    __device__ __forceinline__ auto vt_stages(Element* base) {  // (MMA, N, K, stage) descriptors
      using namespace cute;
      return thr_pv.partition_fragment_B(make_tensor(make_smem_ptr(base), SmemLayoutVt{}));
    }
  };

  // Ping-pong (kPingPong): the two warpgroups take turns issuing their GEMMs, so that one's P / W work overlaps the
  // other's GEMMs instead of both computing while the tensor cores idle; the forward's scheme (fwd_mainloop.cuh's
  // take_turn / pass_turn). Both warpgroups walk the same blocks, so they take the same number of turns (one per
  // block and one for the last PV GEMMs); warpgroup 0 takes the first (start_turns) and the last turn's grant is
  // left unclaimed as in the forward. A turn covers issuing only: no wait for another warpgroup's data happens
  // inside one except the pipelines' stage waits, whose releases never need a turn, so the round cannot deadlock.
  static constexpr bool kPingPong = true;
  __device__ __forceinline__ static void start_turns(int warpgroup) {
    if (kPingPong && warpgroup == 0) {
      cutlass::arch::NamedBarrier::arrive(2 * 128, TangentNamedBarrier::ping_pong(0));
    }
  }
  __device__ __forceinline__ static void take_turn(int warpgroup) {
    if constexpr (kPingPong) cutlass::arch::NamedBarrier::sync(2 * 128, TangentNamedBarrier::ping_pong(warpgroup));
  }
  __device__ __forceinline__ static void pass_turn(int warpgroup) {
    if constexpr (kPingPong) {
      cutlass::arch::NamedBarrier::arrive(2 * 128, TangentNamedBarrier::ping_pong(1 - warpgroup));
    }
  }

  // The pointer, with its value hidden from the compiler: descriptors derived from it are recomputed where used
  // instead of hoisted out of the key loop. Q's and tQ's are loop-invariant, one 64-bit descriptor per 16-wide
  // k-slice each: hoisted, that is 4 * D / 16 registers held across the loop (64 at D 256, where ptxas spilled 188
  // bytes), against a few integer adds per slice and step to rebuild them.
  template <typename T>
  __device__ __forceinline__ static T* opaque(T* ptr) {
    asm volatile("" : "+l"(ptr));
    return ptr;
  }

  // S = Q K^T, tS = tQ K^T + Q tK^T of the next (K, tK) stage: three wgmma batches, left in flight.
  template <typename TK>
  __device__ __forceinline__ static void issue_scores(Consumer& c, PipelineK& pipeline_k, Element* q, Element* tq,
                                                      int warpgroup, TK& tSrK, TK& tSrTk) {
    using namespace cute;
    auto tSrQ = c.q_half(opaque(q), warpgroup);
    auto tSrTq = c.q_half(opaque(tq), warpgroup);
    pipeline_k.consumer_wait(c.read_k);
    const int stage = c.read_k.index();
    common::wgmma_gemm<true, -1>(c.mma_qk, tSrQ, tSrK(_, _, _, stage), c.s);
    common::wgmma_gemm<true, -1>(c.mma_qk, tSrTq, tSrK(_, _, _, stage), c.ts);
    common::wgmma_gemm<false, -1>(c.mma_qk, tSrQ, tSrTk(_, _, _, stage), c.ts);
  }

  // acc += W V + P tV of the next (V, tV) stage with the P and W in registers: two wgmma batches, left in flight.
  template <typename TV, typename AccO>
  __device__ __forceinline__ static void issue_pv(Consumer& c, PipelineV& pipeline_v, TV& tOrV, TV& tOrTv,
                                                  AccO& acc) {
    using namespace cute;
    pipeline_v.consumer_wait(c.read_v);
    const int stage = c.read_v.index();
    common::wgmma_gemm<false, -1>(c.mma_pv, c.w, tOrV(_, _, _, stage), acc);
    common::wgmma_gemm<false, -1>(c.mma_pv, c.p, tOrTv(_, _, _, stage), acc);
  }

  // Waits for the PV GEMMs in flight (their accumulators: acc, the jvp's O and tO; P and W are ours again) and
  // releases their V stage.
  template <typename... AccO>
  __device__ __forceinline__ static void wait_for_pv(Consumer& c, PipelineV& pipeline_v, AccO&... acc) {
    cute::warpgroup_wait<0>();
    (cute::warpgroup_fence_operand(acc), ...);
    cute::warpgroup_fence_operand(c.p);
    cute::warpgroup_fence_operand(c.w);
    pipeline_v.consumer_release(c.read_v);
    ++c.read_v;
  }

  // S_t, tS_t have been waited on (this mainloop's and the jvp's scores_done): they are ours, their K stage free.
  __device__ __forceinline__ static void release_k_stage(Consumer& c, PipelineK& pipeline_k) {
    cute::warpgroup_fence_operand(c.s);
    cute::warpgroup_fence_operand(c.ts);
    pipeline_k.consumer_release(c.read_k);
    ++c.read_k;
  }

  // S_t, tS_t have been waited on: release their K stage and form P_t, W_t in fp32 (in c.s, c.ts).
  template <bool kMasked, typename CoordsRC, typename Mask>
  __device__ __forceinline__ static void scores_done(Consumer& c, PipelineK& pipeline_k, const CoordsRC& coords_rc,
                                                     const Mask& mask, int n_block,
                                                     const common::ScoreTransform& transform, float softmax_scale,
                                                     const float (&lse_log2)[2], float (&w_sum)[2]) {
    using namespace cute;
    release_k_stage(c, pipeline_k);
    Tensor s_rc = common::wgmma_acc_rowcol_view(c.s);
    Tensor ts_rc = common::wgmma_acc_rowcol_view(c.ts);
    probs_and_weights<kMasked>(s_rc, ts_rc, coords_rc, mask, n_block * kBlockN, transform, softmax_scale, lse_log2,
                               w_sum);
  }

  // Step t >= 1, the forward's overlap (fwd_mainloop.cuh's steady_step): on the warpgroup's turn issue S_t, tS_t and
  // acc += W_{t-1} V_{t-1} + P_{t-1} tV_{t-1}; wait for the score GEMMs only, form P_t, W_t while the PV GEMMs run;
  // wait for those, then convert P_t, W_t into their operand registers. Nothing is in flight across the loop's back
  // edge: a wgmma in flight there made ptxas serialize every wgmma (C7514 / C7515: the loop's register copies touch
  // accumulators inside the wgmma pipeline stage).
  template <bool kMasked, typename TK, typename TV, typename CoordsRC, typename Mask, typename AccO>
  __device__ __forceinline__ static void step(Consumer& c, PipelineK& pipeline_k, PipelineV& pipeline_v, Element* q,
                                              Element* tq, int warpgroup, TK& tSrK, TK& tSrTk, TV& tOrV, TV& tOrTv,
                                              const CoordsRC& coords_rc, const Mask& mask, int n_block,
                                              const common::ScoreTransform& transform, float softmax_scale,
                                              const float (&lse_log2)[2], AccO& acc, float (&w_sum)[2]) {
    take_turn(warpgroup);
    issue_scores(c, pipeline_k, q, tq, warpgroup, tSrK, tSrTk);
    issue_pv(c, pipeline_v, tOrV, tOrTv, acc);
    pass_turn(warpgroup);
    cute::warpgroup_wait<2>();  // the three score batches are complete; the two PV batches may still run
    scores_done<kMasked>(c, pipeline_k, coords_rc, mask, n_block, transform, softmax_scale, lse_log2, w_sum);
    wait_for_pv(c, pipeline_v, acc);
    common::convert_fragment_into(c.s, c.p);
    common::convert_fragment_into(c.ts, c.w);
  }

  // The key loop both this mainloop and the fused jvp's (jvp_mainloop.cuh) run, one warpgroup (blocks not empty):
  // block 0's scores, the masked steps, the unmasked bulk, the last PV GEMMs. Steps (this mainloop or the jvp's)
  // says what the warpgroup's state is and does with it: its first_block_done, step, last_pv and wait_for_last_pv
  // take state... last. On return every wgmma has been waited on (the warpgroup's Q and tQ halves are free) and every
  // stage released. Blocks and Mask: the band's (KvBlockRange, TileMask), or a mask mod's block list and
  // band-and-bits mask (tangent_mask_mod.cuh).
  template <typename Steps, typename Blocks, typename Mask, typename... State>
  __device__ __forceinline__ static void run_blocks(TensorStorage& tensors, BarrierStorage& barriers,
                                                    PipelineK& pipeline_k, PipelineV& pipeline_v,
                                                    const Blocks& blocks, const Mask& mask, int warpgroup,
                                                    int thread_in_wg, const common::ScoreTransform& transform,
                                                    float softmax_scale, State&... state) {
    using namespace cute;
    Consumer c(thread_in_wg);
    Element* q = tensors.q.data();
    Element* tq = tensors.tq.data();
    Tensor tSrK = c.k_stages(tensors.k.data());
    Tensor tSrTk = c.k_stages(tensors.tk.data());
    Tensor tOrV = c.vt_stages(tensors.v.data());
    Tensor tOrTv = c.vt_stages(tensors.tv.data());
    // Warpgroup-local (row, col) of each score this thread holds, for the band mask.
    Tensor coords_rc =
        common::wgmma_acc_rowcol_view(c.thr_qk.partition_C(make_identity_tensor(Shape<WgRows, BlockN>{})));

    // Block 0: scores only. It takes the masked path whatever it is (the mask is correct on any block; in visiting
    // order the first block is a masked one whenever the tile has any).
    barriers.q.wait(0);
    start_turns(warpgroup);
    take_turn(warpgroup);
    issue_scores(c, pipeline_k, q, tq, warpgroup, tSrK, tSrTk);
    pass_turn(warpgroup);
    warpgroup_wait<0>();
    Steps::first_block_done(c, pipeline_k, coords_rc, mask, blocks.block_at(0), transform, softmax_scale, state...);
    common::convert_fragment_into(c.s, c.p);
    common::convert_fragment_into(c.ts, c.w);
    // Then the rest of the masked blocks, the unmasked bulk (as the forward visits them), and the last PV GEMMs.
    const int num_blocks = blocks.num_blocks();
    const int num_masked = blocks.num_masked();
    CUTE_NO_UNROLL
    for (int t = 1; t < num_masked; ++t) {
      Steps::template step<true>(c, pipeline_k, pipeline_v, q, tq, warpgroup, tSrK, tSrTk, tOrV, tOrTv, coords_rc,
                                 mask, blocks.block_at(t), transform, softmax_scale, state...);
    }
    CUTE_NO_UNROLL
    for (int t = num_masked > 1 ? num_masked : 1; t < num_blocks; ++t) {
      Steps::template step<false>(c, pipeline_k, pipeline_v, q, tq, warpgroup, tSrK, tSrTk, tOrV, tOrTv, coords_rc,
                                  mask, blocks.block_at(t), transform, softmax_scale, state...);
    }
    take_turn(warpgroup);
    Steps::last_pv(c, pipeline_v, tOrV, tOrTv, state...);
    pass_turn(warpgroup);
    Steps::wait_for_last_pv(c, pipeline_v, state...);
  }

  // The tangent's state for run_blocks: lse_log2 in, acc (W V + P tV) and w_sum (this thread's share of its rows'
  // sums of W) accumulated.
  template <typename CoordsRC, typename Mask, typename AccO>
  __device__ __forceinline__ static void first_block_done(Consumer& c, PipelineK& pipeline_k,
                                                          const CoordsRC& coords_rc, const Mask& mask, int n_block,
                                                          const common::ScoreTransform& transform,
                                                          float softmax_scale, const float (&lse_log2)[2], AccO&,
                                                          float (&w_sum)[2]) {
    scores_done<true>(c, pipeline_k, coords_rc, mask, n_block, transform, softmax_scale, lse_log2, w_sum);
  }
  template <typename TV, typename AccO>
  __device__ __forceinline__ static void last_pv(Consumer& c, PipelineV& pipeline_v, TV& tOrV, TV& tOrTv,
                                                 const float (&)[2], AccO& acc, float (&)[2]) {
    issue_pv(c, pipeline_v, tOrV, tOrTv, acc);
  }
  template <typename AccO>
  __device__ __forceinline__ static void wait_for_last_pv(Consumer& c, PipelineV& pipeline_v, const float (&)[2],
                                                          AccO& acc, float (&)[2]) {
    wait_for_pv(c, pipeline_v, acc);
  }

  // The whole key loop of one warpgroup (blocks not empty). acc must be cleared. On return acc holds W V + P tV over
  // the tile's blocks, w_sum this thread's share of its rows' sums of W (quad-reduced by the caller).
  template <typename AccO, typename Blocks, typename Mask>
  __device__ __forceinline__ static void run(TensorStorage& tensors, BarrierStorage& barriers, PipelineK& pipeline_k,
                                             PipelineV& pipeline_v, const Blocks& blocks,
                                             const Mask& mask, int warpgroup, int thread_in_wg,
                                             const common::ScoreTransform& transform, float softmax_scale,
                                             const float (&lse_log2)[2], AccO& acc, float (&w_sum)[2]) {
    run_blocks<TangentMainloopSm90>(tensors, barriers, pipeline_k, pipeline_v, blocks, mask, warpgroup, thread_in_wg,
                                    transform, softmax_scale, lse_log2, acc, w_sum);
  }
};

}  // namespace flashjax::sm90

// Mainloop of the sm90 forward kernel: the producer warp's TMA loads and the consumer warpgroups' wgmma GEMMs with
// the online softmax between them.
//
// Data flow per tile (consumer warpgroup w owns query rows 64w .. 64w + 63):
//   Q:   one TMA per 64-row part into one of kQStages Q buffers, completing on that buffer's mbarrier (one phase
//        per use); with two buffers the next tile's Q loads while this tile still computes;
//   K/V: kStagesK- and kStagesV-deep ring buffers, each stage a TMA completing on the full mbarrier of a
//        cutlass::PipelineTmaAsync and released by every consumer thread once the wgmma reading it has been waited on.
// KV blocks are visited in common::KvBlockRange::block_at order, the blocks that need the per-element mask first.
// Rows past Sq and keys past Sk are zero-filled by TMA: their scores are finite, the rows are never stored and the
// band mask (which bounds columns by Sk) hides the keys.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/sm90_wgmma.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/fwd_named_barriers.cuh"
#include "kernels/sm90/fwd_softmax.cuh"

namespace flashjax::sm90 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStagesK_, int kStagesV_, int kConsumerWarpgroups_,
          int kQStages_>
struct FwdMainloopSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStagesK = kStagesK_;
  static constexpr int kStagesV = kStagesV_;
  static constexpr int kKLead = kStagesK - 1;  // how many blocks K loads run ahead of V loads (see load())
  static_assert(kKLead >= 1 && kStagesV >= 2);
  static constexpr int kRowsPerWarpgroup = 64;  // the M of one wgmma
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static constexpr int kQStages = kQStages_;
  static_assert(kQStages == 1 || kQStages == 2);
  static constexpr int kBlockM = kRowsPerWarpgroup * kConsumerWarpgroups;
  static_assert(kBlockN % 16 == 0, "kBlockN is the K of O += P V: a multiple of 16");

  using HeadDim = cute::Int<kHeadDim>;
  using BlockN = cute::Int<kBlockN>;
  using WgRows = cute::Int<kRowsPerWarpgroup>;
  using StagesK = cute::Int<kStagesK>;
  using StagesV = cute::Int<kStagesV>;

  // One warpgroup's GEMMs: S = Q K^T with both operands in shared memory (SS), O += P V with P in registers (RS).
  // V is stored as loaded (D contiguous), which makes it the MN-major B operand of P V.
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<WgRows, BlockN, HeadDim>>()));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<WgRows, HeadDim, BlockN>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>()));

  // Swizzled shared layouts in the canonical wgmma forms (the same swizzle is what TMA writes).
  using SmemLayoutAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element,
                                                                                       WgRows, HeadDim>());
  using SmemLayoutQHalf = decltype(cute::tile_to_shape(SmemLayoutAtomQ{}, cute::Shape<WgRows, HeadDim>{}));
  using SmemLayoutAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element,
                                                                                       BlockN, HeadDim>());
  using SmemLayoutK = decltype(cute::tile_to_shape(SmemLayoutAtomK{}, cute::Shape<BlockN, HeadDim, StagesK>{}));
  // V^T view (D, kBlockN, stage) of the row-major V tile: D is the contiguous (MN) mode.
  using SmemLayoutAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::MN,
                                                                                        Element, HeadDim, BlockN>());
  using SmemLayoutVt = decltype(cute::tile_to_shape(SmemLayoutAtomVt{}, cute::Shape<HeadDim, BlockN, StagesV>{},
                                                    cute::Step<cute::_2, cute::_1, cute::_3>{}));

  static constexpr int kQHalfElems = cute::cosize_v<SmemLayoutQHalf>;  // one warpgroup's 64 rows
  static constexpr int kQElems = kConsumerWarpgroups * kQHalfElems;      // one Q buffer

  // A Q buffer can double as the epilogue's O staging buffer (same shape and swizzle): see fwd_epilogue.cuh.
  struct TensorStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> v;
    cute::array_aligned<Element, kQStages * kQElems, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
  };
  // O's own staging buffer, where the kernel has room for one.
  struct OStagingStorage {
    cute::array_aligned<Element, kQElems, 1024> o;
  };

  using PipelineK = cutlass::PipelineTmaAsync<kStagesK>;
  using PipelineV = cutlass::PipelineTmaAsync<kStagesV>;
  using StateK = cutlass::PipelineState<kStagesK>;
  using StateV = cutlass::PipelineState<kStagesV>;
  struct BarrierStorage {
    typename PipelineK::SharedStorage k;
    typename PipelineV::SharedStorage v;
    cutlass::arch::ClusterTransactionBarrier q[kQStages];
  };

  // Global tensors as TMA sees them: (seqlen, D, heads, batch) for Q and K, (D, seqlen, heads, batch) for V^T.
  // One descriptor covers every batch and head; 64-bit strides.
  using ShapeSDHB = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideSDHB = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using StrideDSHB = cute::Stride<cute::_1, int64_t, int64_t, int64_t>;
  using GmemTensorQK = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                  ShapeSDHB{}, StrideSDHB{}));
  using GmemTensorVt = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                  ShapeSDHB{}, StrideDSHB{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorQK{}, SmemLayoutQHalf{},
                                            cute::Shape<WgRows, HeadDim>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorQK{},
                                            cute::take<0, 2>(SmemLayoutK{}), cute::Shape<BlockN, HeadDim>{},
                                            cute::_1{}));
  using TmaVt = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorVt{},
                                             cute::take<0, 2>(SmemLayoutVt{}), cute::Shape<HeadDim, BlockN>{},
                                             cute::_1{}));

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  struct Arguments {
    const Element* q;
    const Element* k;
    const Element* v;
    ShapeSDHB shape_q;  // (Sq, D, Hq, B)
    ShapeSDHB shape_k;  // (Sk, D, Hk, B), Sk clamped to >= 1 (a TMA dimension cannot be 0)
    StrideSDHB stride_q, stride_k, stride_v;
  };

  struct Params {
    TmaQ tma_q;
    TmaK tma_k;
    TmaVt tma_vt;
    ShapeSDHB shape_q;
    ShapeSDHB shape_k;
  };

  static Params to_params(const Arguments& args) {
    using namespace cute;
    Tensor m_q = make_tensor(make_gmem_ptr(args.q), args.shape_q, args.stride_q);
    Tensor m_k = make_tensor(make_gmem_ptr(args.k), args.shape_k, args.stride_k);
    Tensor m_vt = make_tensor(make_gmem_ptr(args.v), select<1, 0, 2, 3>(args.shape_k),
                              select<1, 0, 2, 3>(args.stride_v));
    return {make_tma_copy(SM90_TMA_LOAD{}, m_q, SmemLayoutQHalf{}, Shape<WgRows, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, m_k, take<0, 2>(SmemLayoutK{}), Shape<BlockN, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, m_vt, take<0, 2>(SmemLayoutVt{}), Shape<HeadDim, BlockN>{}, _1{}),
            args.shape_q, args.shape_k};
  }

  __device__ static void prefetch_tma_descriptors(const Params& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_vt.get_tma_descriptor());
  }

  // Q buffer and mbarrier phase of the n-th tile with work (producer and consumers count the same tiles).
  struct QuerySlot {
    int buffer;
    uint32_t phase;
    __device__ explicit QuerySlot(int n) : buffer(n % kQStages), phase((n / kQStages) & 1) {}
  };

  // Producer side of one tile with work (blocks not empty), run by the whole producer warp; `leader` (one lane)
  // issues every TMA and pipeline operation. Load order, with b(t) = blocks.block_at(t): K of b(0), then Q (once
  // the consumers have freed its buffer: QueryEmpty), then K of b(t) and V of b(t - kKLead) alternately, ending
  // with the last V's. The consumers wait for K of b(t), then V of b(t - 1); every stage the producer acquires is
  // freed by consumer work that needs only loads issued before it, so this cannot deadlock.
  //
  // K runs kKLead = kStagesK - 1 blocks ahead of V. With one block (the order the consumers wait in), the K load
  // for block t + 1 queues behind the V load of block t - 1, whose stage frees only when the slower warpgroup ends
  // block t - 3's P V: ncu at D = 128 S = 4k found the consumers waiting for K on 6% of all warp samples, with two
  // or three K stages alike. Two blocks ahead measured +5-16% on rows of <= 8 KV blocks per tile and -2-4% on
  // rows of >= 32 (bench/NOTES.md, v4); choosing the lead per tile at run time measured slower than either.
  // Tiles with no KV block load nothing and take no part in the Q hand-off (their epilogue does not use shared
  // memory: fwd_epilogue.cuh).
  //
  // QueryEmpty pairing, per Q buffer b: the consumers arrive once at kernel start and once after each tile with
  // work that used b; the producer syncs once before each Q it loads into b. The consumers' arrival after tile n
  // comes after they waited for Q_n, which the producer loaded after its sync for tile n, so they can never be two
  // arrivals ahead on one barrier (a named barrier cannot tell two phases' arrivals apart).
  __device__ static void load(const Params& params, TensorStorage& tensors, BarrierStorage& barriers,
                              PipelineK& pipeline_k, PipelineV& pipeline_v, StateK& write_k, StateV& write_v,
                              bool leader,
                              const QuerySlot& q_slot, int m_block, int head_q, int head_k, int batch,
                              const common::KvBlockRange& blocks) {
    using namespace cute;
    constexpr int kProducerAndConsumerThreads = cutlass::NumThreadsPerWarp + kConsumerWarpgroups * 128;
    Tensor s_k = make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutK{});
    Tensor s_vt = make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutVt{});

    Tensor m_q = params.tma_q.get_tma_tensor(params.shape_q)(_, _, head_q, batch);
    Tensor m_k = params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_k, batch);
    Tensor m_vt = params.tma_vt.get_tma_tensor(select<1, 0, 2, 3>(params.shape_k))(_, _, head_k, batch);
    Tensor g_q = local_tile(m_q, Shape<WgRows, HeadDim>{}, make_coord(_, _0{}));  // (64, D, half-tiles of Sq)
    Tensor g_k = local_tile(m_k, Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));  // (kBlockN, D, n_blocks)
    Tensor g_vt = local_tile(m_vt, Shape<HeadDim, BlockN>{}, make_coord(_0{}, _));  // (D, kBlockN, n_blocks)

    auto tma_q = params.tma_q.get_slice(_0{});
    auto tma_k = params.tma_k.get_slice(_0{});
    auto tma_vt = params.tma_vt.get_slice(_0{});
    Tensor tQgQ = group_modes<0, 3>(tma_q.partition_S(g_q));    // (TMA, half-tiles)
    Tensor tKgK = group_modes<0, 3>(tma_k.partition_S(g_k));    // (TMA, n_blocks)
    Tensor tKsK = group_modes<0, 3>(tma_k.partition_D(s_k));    // (TMA, stage)
    Tensor tVgV = group_modes<0, 3>(tma_vt.partition_S(g_vt));  // (TMA, n_blocks)
    Tensor tVsV = group_modes<0, 3>(tma_vt.partition_D(s_vt));  // (TMA, stage)

    // K/V are re-read by every query tile of the head (and every query head of a GQA group): keep them in L2.
    // Q is read by this tile only (EVICT_FIRST below).
    // K and V have pipelines of their own (K may be deeper: it is needed first); the whole warp walks the loop and
    // keeps the states (uniform control flow), only the leader issues.
    auto load_stage = [&](auto& pipeline, auto& state, const auto& tma, const auto& src, auto& dst, int n_block) {
      if (leader) {
        pipeline.producer_acquire(state);
        copy(tma.with(*pipeline.producer_get_barrier(state), 0, TMA::CacheHintSm90::EVICT_LAST), src(_, n_block),
             dst(_, state.index()));
      }
      ++state;
    };
    auto load_k = [&](int n_block) { load_stage(pipeline_k, write_k, params.tma_k, tKgK, tKsK, n_block); };
    auto load_v = [&](int n_block) { load_stage(pipeline_v, write_v, params.tma_vt, tVgV, tVsV, n_block); };

    load_k(blocks.block_at(0));
    __syncwarp();
    cutlass::arch::NamedBarrier::sync(kProducerAndConsumerThreads, FwdNamedBarrier::query_empty(q_slot.buffer));
    if (leader) {
      auto& barrier_q = barriers.q[q_slot.buffer];
      barrier_q.arrive_and_expect_tx(kTmaBytesQ);
      CUTE_UNROLL
      for (int half = 0; half < kConsumerWarpgroups; ++half) {
        // A half past Sq (Sq - m_start <= 64) is a box entirely out of bounds: TMA fills it with zeros and still
        // counts its bytes, so the expected transaction size is the same for every tile.
        Tensor s_q_half = make_tensor(
            make_smem_ptr(tensors.q.data() + q_slot.buffer * kQElems + half * kQHalfElems), SmemLayoutQHalf{});
        copy(params.tma_q.with(reinterpret_cast<uint64_t&>(barrier_q), 0, TMA::CacheHintSm90::EVICT_FIRST),
             tQgQ(_, m_block * kConsumerWarpgroups + half), group_modes<0, 3>(tma_q.partition_D(s_q_half)));
      }
    }
    const int num_blocks = blocks.num_blocks();
    for (int t = 1; t < num_blocks + kKLead; ++t) {
      if (t < num_blocks) load_k(blocks.block_at(t));
      if (t >= kKLead) load_v(blocks.block_at(t - kKLead));
    }
    __syncwarp();
  }

  // Consumer side of one tile, run by one consumer warpgroup (thread_in_wg in [0, 128)). Accumulates the
  // unnormalized O of its 64 rows into acc_o (cleared here) and the row statistics into softmax.
  //
  // Per visited block t after the first, with the PV GEMM lagging one block behind the QK GEMM:
  //   issue S_t = Q K_t^T; issue O += P_{t-1} V_{t-1}  (both asynchronous; the ping-pong barrier lets the other
  //                                                     warpgroup's softmax run while these occupy the tensor cores)
  //   wait for S_t, release K_t; softcap, mask, online softmax of S_t   (overlaps the PV GEMM)
  //   wait for the PV GEMM, release V_{t-1}; rescale O; P_t = bf16/fp16(S_t)
  template <typename AccO, typename Softmax>
  __device__ static void mma(TensorStorage& tensors, BarrierStorage& barriers, PipelineK& pipeline_k,
                             PipelineV& pipeline_v, StateK& read_k, StateV& read_v,
                             const QuerySlot& q_slot, int warpgroup, int thread_in_wg,
                             const common::KvBlockRange& blocks,
                             const common::TileMask& tile_mask, const common::ScoreTransform& transform, AccO& acc_o,
                             Softmax& softmax) {
    using namespace cute;
    Tensor s_q = make_tensor(make_smem_ptr(tensors.q.data() + q_slot.buffer * kQElems + warpgroup * kQHalfElems),
                             SmemLayoutQHalf{});
    Tensor s_k = make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutK{});
    Tensor s_vt = make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutVt{});

    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    auto thr_mma_qk = mma_qk.get_thread_slice(thread_in_wg);
    auto thr_mma_pv = mma_pv.get_thread_slice(thread_in_wg);
    Tensor tSrQ = thr_mma_qk.partition_fragment_A(s_q);   // smem descriptors
    Tensor tSrK = thr_mma_qk.partition_fragment_B(s_k);   // (MMA, N, K, stage)
    Tensor tOrV = thr_mma_pv.partition_fragment_B(s_vt);  // (MMA, N, K, stage)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<WgRows, BlockN>{});
    Tensor tSrS_rc = common::wgmma_acc_rowcol_view(tSrS);
    Tensor tOrP = make_tensor<Element>(common::wgmma_acc_as_a_layout(tSrS.layout()));
    Tensor acc_o_rc = common::wgmma_acc_rowcol_view(acc_o);
    // Warpgroup-local (row, col) of each score this thread holds, for the band mask.
    Tensor tScS_rc =
        common::wgmma_acc_rowcol_view(thr_mma_qk.partition_C(make_identity_tensor(Shape<WgRows, BlockN>{})));

    float correction[Softmax::kNumRows];
    const int num_blocks = blocks.num_blocks();
    const int num_masked = blocks.num_masked();
    auto scores_to_probabilities = [&](int t) {
      transform_and_mask_scores(tSrS_rc, tScS_rc, transform, tile_mask, t < num_masked,
                                blocks.block_at(t) * kBlockN);
      softmax.update(tSrS_rc, correction);
    };
    auto release = [](auto& pipeline, auto& state) {
      pipeline.consumer_release(state);
      ++state;
    };

    clear(acc_o);
    barriers.q[q_slot.buffer].wait(q_slot.phase);

    // First block: nothing to overlap with, and O is still zero (no rescale).
    pipeline_k.consumer_wait(read_k);
    common::wgmma_gemm</*kZeroInit=*/true, /*kWaitGroups=*/0>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
    release(pipeline_k, read_k);
    scores_to_probabilities(0);
    common::convert_fragment_into(tSrS, tOrP);

    CUTE_NO_UNROLL
    for (int t = 1; t < num_blocks; ++t) {
      cutlass::arch::NamedBarrier::sync(2 * 128, FwdNamedBarrier::ping_pong(warpgroup));
      pipeline_k.consumer_wait(read_k);
      common::wgmma_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
      pipeline_v.consumer_wait(read_v);
      common::wgmma_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
      cutlass::arch::NamedBarrier::arrive(2 * 128, FwdNamedBarrier::ping_pong((warpgroup + 1) % kConsumerWarpgroups));

      warpgroup_wait<1>();  // S_t is complete; the PV GEMM may still run
      warpgroup_fence_operand(tSrS);
      release(pipeline_k, read_k);
      scores_to_probabilities(t);

      warpgroup_wait<0>();  // the PV GEMM is complete: O and P are ours again
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      release(pipeline_v, read_v);
      Softmax::rescale_o(acc_o_rc, correction);
      common::convert_fragment_into(tSrS, tOrP);
    }

    pipeline_v.consumer_wait(read_v);
    common::wgmma_gemm<false, 0>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
    release(pipeline_v, read_v);
  }
};

}  // namespace flashjax::sm90

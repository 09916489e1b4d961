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
// band mask (which bounds columns by Sk) hides the keys. A tile of packed GQA (fwd_query_tiling.cuh) loads its Q in
// 8-row chunks, one TMA box each, into the same shared-memory image; nothing else here tells the two apart.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/mask_bits.cuh"
#include "kernels/common/mask_block_lists.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/fwd_named_barriers.cuh"
#include "kernels/sm90/fwd_query_tiling.cuh"
#include "kernels/sm90/fwd_softmax.cuh"
#include "kernels/sm90/fwd_varlen_ring.cuh"
#include "kernels/sm90/mainloop_types.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStagesK_, int kStagesV_, int kConsumerWarpgroups_,
          int kQStages_, bool kSoftcap_, bool kPackGqa_, bool kSkipIdle_ = false, bool kVarlen_ = false,
          bool kMaskMod_ = false>
struct FwdMainloopSm90 : MainloopTypesSm90<Element_, kHeadDim_, kBlockN_, kStagesK_, kStagesV_> {
  // GEMMs, shared layouts, stage rings and TMA types: mainloop_types.cuh.
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
  using typename Types::SmemLayoutAtomQ;
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
  using typename Types::GmemTensorQK;
  using typename Types::TmaQ;
  using typename Types::TmaK;
  using typename Types::TmaVt;
  using Types::kTmaBytesKV;
  static_assert(kStagesK >= 2 && kStagesV >= 2);
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static constexpr int kQStages = kQStages_;
  static_assert(kQStages == 1 || kQStages == 2);
  // Compiled for soft-capped calls. A separate kernel because the capping code inside the hot loops, even branched
  // around at run time, cost uncapped calls 2-5% (instruction fetch around it; docs/performance.md, lever table).
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr int kBlockM = kRowsPerWarpgroup * kConsumerWarpgroups;
  static_assert(kBlockN % 16 == 0, "kBlockN is the K of O += P V: a multiple of 16");

  static constexpr int kQElems = kConsumerWarpgroups * kQHalfElems;      // one Q buffer

  static constexpr bool kPackGqa = kPackGqa_;  // tiles of packed GQA (fwd_query_tiling.cuh)
  // A warpgroup whose rows all lie past Sq (ConsumerTile::idle) skips the GEMMs and softmax of its blocks, keeping
  // its ping-pong turns and stage releases; only the tail turn's GEMMs go out as usual (see tail()). Compiled into
  // the split-keys kernel, whose decode-sized packed tiles leave the second warpgroup all padding (GQA 32:8 decode:
  // 4 real rows of 128), and into the packed varlen kernel (the same decode tiles, per sequence: rows past its used
  // positions); elsewhere a warpgroup past Sq is rare and the checks would sit in the per-tile path of every kernel.
  static constexpr bool kSkipIdle = kSkipIdle_;
  // Packed sequences (fwd_varlen_scheduler.cuh): the descriptors span the packed [T, H, D] tensors as one batch, and
  // a tile's boxes start at its sequence's first row (LoadCoords::q_start / k_start) plus its block offset, so they
  // need not be aligned to the block size. Rows a box takes past the sequence belong to the next one (or are TMA's
  // zero fill past T): harmless for Q (those rows are never stored) and for K/V hidden by the key bound of the
  // band mask (the sequence's used keys), as rows past Sk are in a dense call. A compile-time flag, so that the dense
  // kernels' code is what it was.
  static constexpr bool kVarlen = kVarlen_;
  // A mask mod (issue 38): each tile walks its list of KV blocks (kernels/common/mask_block_lists.cuh: the band's
  // blocks less the empty tiles, the masked and partial ones first), and the masked steps apply the mod's bits on top
  // of the band. The list answers what KvBlockRange answers, so the loads and the loops below are the same code; the
  // bits add to the masked steps only. Compile-time, so that the other kernels keep their code.
  static constexpr bool kMaskMod = kMaskMod_;
  static_assert(!(kMaskMod && (kVarlen || kPackGqa || kSkipIdle)), "mask-mod tiles: one dense query head's rows");
  static_assert(!kMaskMod || kBlockN % 32 == 0, "mask-bit words must not straddle a mask-mod tile's n-blocks");
  using BlockRange = std::conditional_t<kMaskMod, common::ListedKvBlocks, common::KvBlockRange>;
  using QueryTiling = FwdQueryTiling<kBlockM, kPackGqa>;
  // Packed GQA's 8-row chunks: rows [8j, 8j + 8) of a 64-row half are its j-th swizzle atom (tile_to_shape stacks
  // the atoms along M first), so chunk j lies kQChunkElems * j elements in, with the atom's own layout and swizzle
  // (the offset is a whole number of swizzle periods), and within the chunk a row is as far from the next as in
  // the half. The chunk's layout is the half's, restricted to its first 8 rows.
  static constexpr int kChunkRows = QueryTiling::kChunkRows;
  static_assert(cute::size<0>(SmemLayoutAtomQ{}) == kChunkRows, "a chunk is one swizzle atom of rows");
  static constexpr int kQChunkElems = cute::cosize_v<SmemLayoutAtomQ>;
  static constexpr int kChunksPerHalf = kRowsPerWarpgroup / kChunkRows;
  using SmemLayoutQChunk = decltype(cute::composition(
      SmemLayoutQHalf{}, cute::make_layout(cute::Shape<cute::Int<kChunkRows>, HeadDim>{},
                                           cute::Stride<cute::_1, WgRows>{})));

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

  struct DenseBarrierStorage {
    typename PipelineK::SharedStorage k;
    typename PipelineV::SharedStorage v;
    cutlass::arch::ClusterTransactionBarrier q[kQStages];
  };
  // Varlen: V boxes that reach past the sequence's used keys land on a barrier of their own first (load_v_varlen).
  struct VarlenBarrierStorage : DenseBarrierStorage {
    cutlass::arch::ClusterTransactionBarrier v_past_keys;
    // The end of the CTA's range of walk positions (fwd_varlen_balance.cuh), one slot per warp: each warp computes
    // it and reads it back per tile, rather than keeping it in a register through the mainloop. The dynamic walk
    // keeps each warp's count of ring slots there instead.
    int walk_end[16];
    VarlenTicketRing::Storage ring;  // the dynamic walk's hand-off of positions (fwd_varlen_ring.cuh)
  };
  using BarrierStorage = std::conditional_t<kVarlen, VarlenBarrierStorage, DenseBarrierStorage>;

  // Packed GQA's Q boxes (the other TMA types: mainloop_types.cuh).
  using TmaQChunk = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorQK{}, SmemLayoutQChunk{},
                                                 cute::Shape<cute::Int<kChunkRows>, HeadDim>{}, cute::_1{}));

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);

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
    TmaQChunk tma_q_chunk;  // kPackGqa only (left default otherwise: encoding a descriptor costs host time)
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
    Params params{make_tma_copy(SM90_TMA_LOAD{}, m_q, SmemLayoutQHalf{}, Shape<WgRows, HeadDim>{}, _1{}),
                  TmaQChunk{},
                  make_tma_copy(SM90_TMA_LOAD{}, m_k, take<0, 2>(SmemLayoutK{}), Shape<BlockN, HeadDim>{}, _1{}),
                  make_tma_copy(SM90_TMA_LOAD{}, m_vt, take<0, 2>(SmemLayoutVt{}), Shape<HeadDim, BlockN>{}, _1{}),
                  args.shape_q, args.shape_k};
    if constexpr (kPackGqa) {
      params.tma_q_chunk =
          make_tma_copy(SM90_TMA_LOAD{}, m_q, SmemLayoutQChunk{}, Shape<Int<kChunkRows>, HeadDim>{}, _1{});
    }
    return params;
  }

  __device__ static void prefetch_tma_descriptors(const Params& params) {
    cute::prefetch_tma_descriptor(kPackGqa ? params.tma_q_chunk.get_tma_descriptor()
                                           : params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_vt.get_tma_descriptor());
  }

  // Q buffer and mbarrier phase of the n-th tile with work (producer and consumers count the same tiles).
  struct QuerySlot {
    int buffer;
    uint32_t phase;
    __device__ explicit QuerySlot(int n) : buffer(n % kQStages), phase((n / kQStages) & 1) {}
  };

  // Producer side of one tile with work (blocks not empty), split over two warps of the producer warpgroup so that
  // neither tensor's loads queue behind the other's stage releases: warp 0 loads K of b(0), then Q (once the
  // consumers have freed its buffer: QueryEmpty), then K of b(1), b(2), ... (load_q_k); warp 1 loads V of b(0),
  // b(1), ... (load_v; at the CTA's first tile only after that tile's Q has landed: fwd_kernel.cuh);
  // b(t) = blocks.block_at(t). In each warp one lane (`leader`, the pipeline's is_leader)
  // issues; the whole warp walks the loop and keeps the pipeline state (uniform control flow). Each ring is a plain
  // producer-consumer ring: the consumers release K of b(t) after waiting for K of b(t) and V of b(t - 1), both
  // loaded by warps that never wait on each other, so neither ring can deadlock. (With one warp issuing both, in
  // the consumers' order K(t), V(t-1), a K load queued behind a V stage release: ncu at D = 128 S = 4k found the
  // consumers waiting for K on 6% of all warp samples; a fixed lead of K over V traded short tiles against long
  // ones: docs/performance.md.)
  // Tiles with no KV block load nothing and take no part in the Q hand-off (their epilogue does not use shared
  // memory: fwd_epilogue.cuh).
  //
  // QueryEmpty pairing, per Q buffer b: the consumers arrive once at kernel start and once after each tile with
  // work that used b; warp 0 syncs once before each Q it loads into b. The consumers' arrival after tile n comes
  // after they waited for Q_n, which warp 0 loaded after its sync for tile n, so they can never be two arrivals
  // ahead on one barrier (a named barrier cannot tell two phases' arrivals apart). The consumers wait for Q of
  // tile n + 1 before tile n's epilogue (tail_and_prefetch, two Q buffers only); that buffer was freed after tile
  // n - 1, whose epilogue came first, so the wait never depends on tile n's own arrival.
  struct DenseLoadCoords {
    int m_block;
    int head;  // the scheduler's: the query head, or the KV head of a packed tile
    int head_k;
    int batch;
  };
  struct VarlenLoadCoords : DenseLoadCoords {
    int q_start;  // the sequence's first query row and first key in the packed tensors
    int k_start;
    int seqlen_k;  // its used keys
  };
  // The varlen fields exist only in the varlen kernel (with them in every kernel, unread, ptxas allocated the dense
  // D 128 kernels' registers differently in ~100 instructions).
  using LoadCoords = std::conditional_t<kVarlen, VarlenLoadCoords, DenseLoadCoords>;

  // A (rows, D) global tensor (TMA coordinates) whose row 0 is the sequence's first row where kVarlen, else the
  // tensor itself. kRowsMode: which mode counts rows (1 for V^T's (D, rows)); kKeys: K/V's rows, else Q's.
  template <int kRowsMode, bool kKeys, typename Tensor>
  __device__ __forceinline__ static auto from_row(const Tensor& tensor, const LoadCoords& at) {
    using namespace cute;
    if constexpr (kVarlen) {
      const int start = kKeys ? at.k_start : at.q_start;
      if constexpr (kRowsMode == 0) {
        return domain_offset(make_coord(start, _0{}), tensor);
      } else {
        return domain_offset(make_coord(_0{}, start), tensor);
      }
    } else {
      return tensor;
    }
  }

  // K/V are re-read by every query tile of the head (and every query head of a GQA group): keep them in L2.
  template <typename Pipeline, typename State, typename Tma, typename Src, typename Dst>
  __device__ static void load_stage(Pipeline& pipeline, State& state, const Tma& tma, const Src& src, Dst& dst,
                                    int n_block, bool leader) {
    using namespace cute;
    if (leader) {
      pipeline.producer_acquire(state);
      copy(tma.with(*pipeline.producer_get_barrier(state), 0, TMA::CacheHintSm90::EVICT_LAST), src(_, n_block),
           dst(_, state.index()));
    }
    ++state;
  }

  // Q of one tile into Q buffer `q_buffer`, completing on `barrier_q` (armed by the caller): one box per 64-row
  // half, or where GQA is packed one per 8-row chunk, each chunk at its own position and query head. A box past Sq
  // (a half or chunk wholly beyond the last position) is entirely out of bounds: TMA fills it with zeros and still
  // counts its bytes, so the expected transaction size is the same for every tile. Q is read by this tile only:
  // EVICT_FIRST.
  __device__ static void load_q(const Params& params, TensorStorage& tensors,
                                cutlass::arch::ClusterTransactionBarrier& barrier_q, int q_buffer,
                                const QueryTiling& tiling, const LoadCoords& at) {
    using namespace cute;
    Element* q_tile = tensors.q.data() + q_buffer * kQElems;
    auto& barrier = reinterpret_cast<uint64_t&>(barrier_q);
    if constexpr (!kPackGqa) {
      Tensor m_q = from_row<0, false>(params.tma_q.get_tma_tensor(params.shape_q)(_, _, at.head, at.batch), at);
      Tensor g_q = local_tile(m_q, Shape<WgRows, HeadDim>{}, make_coord(_, _0{}));  // (64, D, half-tiles of Sq)
      auto tma_q = params.tma_q.get_slice(_0{});
      Tensor tQgQ = group_modes<0, 3>(tma_q.partition_S(g_q));  // (TMA, half-tiles)
      CUTE_UNROLL
      for (int half = 0; half < kConsumerWarpgroups; ++half) {
        Tensor s_q_half = make_tensor(make_smem_ptr(q_tile + half * kQHalfElems), SmemLayoutQHalf{});
        copy(params.tma_q.with(barrier, 0, TMA::CacheHintSm90::EVICT_FIRST),
             tQgQ(_, at.m_block * kConsumerWarpgroups + half), group_modes<0, 3>(tma_q.partition_D(s_q_half)));
      }
    } else {
      auto tma_q = params.tma_q_chunk.get_slice(_0{});
      Tensor m_q = params.tma_q_chunk.get_tma_tensor(params.shape_q);  // (Sq, D, Hq, B)
      CUTE_NO_UNROLL
      for (int j = 0; j < QueryTiling::kChunksPerTile; ++j) {
        const auto chunk = tiling.chunk(at.m_block * QueryTiling::kChunksPerTile + j, at.head);
        // Varlen: positions count from the sequence's first row (from_row), so chunks start anywhere in the tensor.
        Tensor g_chunk = local_tile(from_row<0, false>(m_q(_, _, chunk.head_q, at.batch), at),
                                    Shape<Int<kChunkRows>, HeadDim>{}, make_coord(chunk.position / kChunkRows, _0{}));
        Tensor s_chunk = make_tensor(
            make_smem_ptr(q_tile + (j / kChunksPerHalf) * kQHalfElems + (j % kChunksPerHalf) * kQChunkElems),
            SmemLayoutQChunk{});
        copy(params.tma_q_chunk.with(barrier, 0, TMA::CacheHintSm90::EVICT_FIRST), tma_q.partition_S(g_chunk),
             tma_q.partition_D(s_chunk));
      }
    }
  }

  __device__ static void load_q_k(const Params& params, TensorStorage& tensors, BarrierStorage& barriers,
                                  PipelineK& pipeline_k, StateK& write_k, bool leader, const QuerySlot& q_slot,
                                  const QueryTiling& tiling, const LoadCoords& at, const BlockRange& blocks) {
    using namespace cute;
    constexpr int kProducerAndConsumerThreads = cutlass::NumThreadsPerWarp + kConsumerWarpgroups * 128;
    Tensor s_k = make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutK{});
    Tensor m_k = from_row<0, true>(params.tma_k.get_tma_tensor(params.shape_k)(_, _, at.head_k, at.batch), at);
    Tensor g_k = local_tile(m_k, Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));  // (kBlockN, D, n_blocks)
    auto tma_k = params.tma_k.get_slice(_0{});
    Tensor tKgK = group_modes<0, 3>(tma_k.partition_S(g_k));  // (TMA, n_blocks)
    Tensor tKsK = group_modes<0, 3>(tma_k.partition_D(s_k));  // (TMA, stage)

    load_stage(pipeline_k, write_k, params.tma_k, tKgK, tKsK, blocks.block_at(0), leader);
    __syncwarp();
    cutlass::arch::NamedBarrier::sync(kProducerAndConsumerThreads, FwdNamedBarrier::query_empty(q_slot.buffer));
    if (leader) {
      auto& barrier_q = barriers.q[q_slot.buffer];
      barrier_q.arrive_and_expect_tx(kTmaBytesQ);
      load_q(params, tensors, barrier_q, q_slot.buffer, tiling, at);
    }
    for (int t = 1; t < blocks.num_blocks(); ++t) {
      load_stage(pipeline_k, write_k, params.tma_k, tKgK, tKsK, blocks.block_at(t), leader);
    }
    __syncwarp();
  }

  __device__ static void load_v(const Params& params, TensorStorage& tensors, PipelineV& pipeline_v,
                                StateV& write_v, bool leader, const LoadCoords& at, const BlockRange& blocks) {
    using namespace cute;
    Tensor s_vt = make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutVt{});
    Tensor m_vt = from_row<1, true>(
        params.tma_vt.get_tma_tensor(select<1, 0, 2, 3>(params.shape_k))(_, _, at.head_k, at.batch), at);
    Tensor g_vt = local_tile(m_vt, Shape<HeadDim, BlockN>{}, make_coord(_0{}, _));  // (D, kBlockN, n_blocks)
    auto tma_vt = params.tma_vt.get_slice(_0{});
    Tensor tVgV = group_modes<0, 3>(tma_vt.partition_S(g_vt));  // (TMA, n_blocks)
    Tensor tVsV = group_modes<0, 3>(tma_vt.partition_D(s_vt));  // (TMA, stage)
    for (int t = 0; t < blocks.num_blocks(); ++t) {
      load_stage(pipeline_v, write_v, params.tma_vt, tVgV, tVsV, blocks.block_at(t), leader);
    }
    __syncwarp();
  }

  // Zeroes rows [row_begin, row_end) of V stage `stage` in s_vt (the swizzled V^T view, (D, kBlockN, stage)), in
  // 16-byte runs of D (the swizzle permutes whole 16-byte units, so each run is contiguous), `lane` of `lanes`
  // threads. Each run is addressed through the tensor, whose swizzled pointer applies the swizzle to byte addresses
  // as TMA and wgmma do; SmemLayoutVt{}(coord) would apply it to element offsets, which for 2-byte elements put some
  // runs on rows of used keys (tests/cpp/test_sm90_varlen_v_rows.cu). Host and device: the host test runs it.
  template <typename TensorVt>
  __host__ __device__ static void zero_v_rows(TensorVt& s_vt, int row_begin, int row_end, int stage, int lane,
                                              int lanes) {
    constexpr int kVecElems = 16 / sizeof(Element);
    constexpr int kVecsPerRow = kHeadDim / kVecElems;
    static_assert(kHeadDim % kVecElems == 0);
    for (int i = lane + row_begin * kVecsPerRow; i < row_end * kVecsPerRow; i += lanes) {
      *reinterpret_cast<uint4*>(&s_vt((i % kVecsPerRow) * kVecElems, i / kVecsPerRow, stage)) = make_uint4(0, 0, 0, 0);
    }
  }

  // load_v for packed sequences. A V box that reaches past the sequence's used keys holds rows of the next sequence
  // (or unused rows past seqused_k) that the band mask hides from the scores, but O += P V multiplies them by P = 0,
  // and 0 * inf or 0 * NaN is NaN: such a box lands on a barrier of its own (barriers.v_past_keys), the warp zeroes
  // those rows (as the sm80 family's predicated loads read zeros there, and the reference zeroes unused tokens), and
  // only then completes the stage's transaction on its full barrier, which the consumers wait on. Rows past T are
  // TMA's zero fill already. The fence orders the generic-proxy zeros before the wgmma reads (async proxy) that the
  // consumers issue once they see the stage full. v_past_keys_phase: the warp's count of such boxes, mod 2.
  __device__ static void load_v_varlen(const Params& params, TensorStorage& tensors, BarrierStorage& barriers,
                                       PipelineV& pipeline_v, StateV& write_v, bool leader, const LoadCoords& at,
                                       const BlockRange& blocks, uint32_t& v_past_keys_phase) {
    using namespace cute;
    static_assert(kVarlen);
    Tensor s_vt = make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutVt{});
    Tensor m_vt = from_row<1, true>(
        params.tma_vt.get_tma_tensor(select<1, 0, 2, 3>(params.shape_k))(_, _, at.head_k, at.batch), at);
    Tensor g_vt = local_tile(m_vt, Shape<HeadDim, BlockN>{}, make_coord(_0{}, _));  // (D, kBlockN, n_blocks)
    auto tma_vt = params.tma_vt.get_slice(_0{});
    Tensor tVgV = group_modes<0, 3>(tma_vt.partition_S(g_vt));  // (TMA, n_blocks)
    Tensor tVsV = group_modes<0, 3>(tma_vt.partition_D(s_vt));  // (TMA, stage)
    const int rows_in_tensor = get<0>(params.shape_k) - at.k_start;  // rows of the packed tensor from the start on
    for (int t = 0; t < blocks.num_blocks(); ++t) {
      const int n_block = blocks.block_at(t);
      const int past_begin = at.seqlen_k - n_block * kBlockN;  // first box row past the used keys (> 0)
      const int past_end = min(kBlockN, rows_in_tensor - n_block * kBlockN);
      if (past_begin >= past_end) {
        load_stage(pipeline_v, write_v, params.tma_vt, tVgV, tVsV, n_block, leader);
        continue;
      }
      auto& landed = barriers.v_past_keys;
      if (leader) {
        pipeline_v.producer_acquire(write_v);  // arms the full barrier with the stage's bytes
        landed.arrive_and_expect_tx(kTmaBytesKV);
        copy(params.tma_vt.with(reinterpret_cast<uint64_t&>(landed), 0, TMA::CacheHintSm90::EVICT_LAST),
             tVgV(_, n_block), tVsV(_, write_v.index()));
      }
      __syncwarp();
      landed.wait(v_past_keys_phase);
      v_past_keys_phase ^= 1;
      zero_v_rows(s_vt, past_begin, past_end, write_v.index(), threadIdx.x % 32, 32);
      cutlass::arch::fence_view_async_shared();
      __syncwarp();
      if (leader) {
        __threadfence_block();
        cutlass::arch::ClusterTransactionBarrier::complete_transaction(pipeline_v.producer_get_barrier(write_v),
                                                                       cute::block_rank_in_cluster(), kTmaBytesKV);
      }
      ++write_v;
    }
    __syncwarp();
  }

  // ---- Consumer side, run by each consumer warpgroup (thread_in_wg in [0, 128)) ----
  //
  // A tile's blocks t = 0 .. n - 1 (visiting order: KvBlockRange::block_at), with the PV GEMM one block behind:
  //   first block   S_0 = Q K_0^T; P_0 = softmax(S_0)                           (first_block or finish_prefetch)
  //   steady step t issue S_t = Q K_t^T and O += P_{t-1} V_{t-1} on the warpgroup's turn (ping-pong), then
  //                 softmax of S_t while the PV GEMM runs, rescale O, P_t       (steady_blocks)
  //   tail          issue O += P_{n-1} V_{n-1} on the warpgroup's turn, and with it the next tile's S_0 where its Q
  //                 buffer is already loaded (a second Q buffer): the kernel's epilogue of this tile then runs
  //                 while that GEMM occupies the tensor cores, and the next tile's first softmax takes part in
  //                 the ping-pong instead of idling them (tail_and_prefetch, then finish_prefetch; tail alone
  //                 after the CTA's last tile or with one Q buffer)
  // Every warpgroup takes one ping-pong turn per steady step and one per tail, and all walk the same tiles, so the
  // turns stay in one round across tiles. (A tail outside the round measured equal or slower on the H200.)

  // Register state a consumer warpgroup carries from block to block and from one tile into the next.
  using FragS = decltype(cute::partition_fragment_C(TiledMmaQK{}, cute::Shape<WgRows, BlockN>{}));
  using FragP = decltype(cute::make_tensor<Element>(common::wgmma_acc_as_a_layout(FragS{}.layout())));
  struct ConsumerState {
    StateK read_k;
    StateV read_v;
    FragS s;  // S_t, then P_t in fp32 until converted
    FragP p;  // P_t as the A operand of O += P V
  };

  // A mask mod's bits for the warpgroup's rows: its (batch, query head)'s rows and the first row's position.
  struct WarpgroupMaskBits {
    common::MaskBitsRows rows;
    int m_start;
  };
  struct NoMaskBits {};

  // What the consumers need of one tile with work.
  struct ConsumerTile {
    QuerySlot q_slot;
    BlockRange blocks;
    // The band mask of the warpgroup's rows (consecutive positions), or where GQA is packed of this thread's two.
    std::conditional_t<kPackGqa, common::RowsMask<2>, common::TileMask> mask;
    bool idle = false;  // kSkipIdle only: every row of the warpgroup lies past Sq
    std::conditional_t<kMaskMod, WarpgroupMaskBits, NoMaskBits> bits{};  // kMaskMod only
  };

  // The warpgroup-local rows (0..63) of this thread's score and O fragments, in the fragments' row order: the band
  // mask, the sinks and the LSE of a tile are taken per row from them.
  __device__ __forceinline__ static void thread_rows(int thread_in_wg, int (&rows)[2]) {
    using namespace cute;
    Tensor coords_rc = common::wgmma_acc_rowcol_view(
        TiledMmaQK{}.get_thread_slice(thread_in_wg).partition_C(make_identity_tensor(Shape<WgRows, BlockN>{})));
    static_assert(decltype(size<0>(coords_rc))::value == 2, "a thread holds two rows of a 64-row wgmma tile");
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) rows[r] = get<0>(coords_rc(r, 0));
  }

  static constexpr bool kCanPrefetchQuery = kQStages == 2;
  // The online softmax skips O's rescale while no row max grew much (FwdOnlineSoftmaxSm90). Measured at D 256
  // (128 multiplies of O against 40 exps per thread and block): +3-5%; D 192 (96 against 56): equal; D 64 / 128
  // (the branch costs more than it saves there): -2-5% (docs/performance.md, lever table).
  static constexpr bool kLazyRescale = kHeadDim > 192;
  // The unmasked blocks after the first exponentiate against the running reference without a row max
  // (FwdOnlineSoftmaxSm90::exponentiate_at_reference). Measured: D 128 +9-11%, D 64 +7-14%; D 256 +1-2% without a
  // causal mask but -2-4% with one, against the lazy rescale above, which it keeps (docs/performance.md, lever table).
  static constexpr bool kExponentiateAtReference = !kLazyRescale;

  // The warpgroup's view of its Q rows, the K and V stages, and its GEMMs.
  struct Operands {
    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    decltype(TiledMmaQK{}.get_thread_slice(0)) thr_mma_qk;
    decltype(TiledMmaPV{}.get_thread_slice(0)) thr_mma_pv;
    __device__ __forceinline__ Operands(int thread_in_wg)
        : thr_mma_qk(mma_qk.get_thread_slice(thread_in_wg)), thr_mma_pv(mma_pv.get_thread_slice(thread_in_wg)) {}
    __device__ __forceinline__ auto q(TensorStorage& tensors, const QuerySlot& slot, int warpgroup) {
      using namespace cute;
      return thr_mma_qk.partition_fragment_A(make_tensor(
          make_smem_ptr(tensors.q.data() + slot.buffer * kQElems + warpgroup * kQHalfElems), SmemLayoutQHalf{}));
    }
    __device__ __forceinline__ auto k(TensorStorage& tensors) {  // (MMA, N, K, stage) descriptors
      using namespace cute;
      return thr_mma_qk.partition_fragment_B(make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutK{}));
    }
    __device__ __forceinline__ auto vt(TensorStorage& tensors) {  // (MMA, N, K, stage) descriptors
      using namespace cute;
      return thr_mma_pv.partition_fragment_B(make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutVt{}));
    }
  };

  // The ping-pong round: a warpgroup takes its turn on the tensor cores (waits until the previous one has issued
  // its GEMMs) and, once its own are issued, passes the turn on (256 threads per barrier: the waiting warpgroup and
  // the one granting the turn).
  __device__ __forceinline__ static void take_turn(int warpgroup) {
    cutlass::arch::NamedBarrier::sync(2 * 128, FwdNamedBarrier::ping_pong(warpgroup));
  }
  __device__ __forceinline__ static void pass_turn(int warpgroup) {
    cutlass::arch::NamedBarrier::arrive(2 * 128, FwdNamedBarrier::ping_pong((warpgroup + 1) % kConsumerWarpgroups));
  }

  template <typename Pipeline, typename State>
  __device__ __forceinline__ static void release(Pipeline& pipeline, State& state) {
    pipeline.consumer_release(state);
    ++state;
  }

  // Softcap and band mask of S_t, in place (kMasked: the block needs the per-element mask; the masked blocks come
  // first in visiting order and run in a loop of their own, so the unmasked bulk carries none of the mask's code or
  // registers). Returns the (row, col) view of the scores, ready for the online softmax.
  template <bool kMasked>
  __device__ __forceinline__ static auto transformed_scores(ConsumerState& state, Operands& ops,
                                                            const ConsumerTile& tile, int t,
                                                            const common::ScoreTransform& transform) {
    using namespace cute;
    Tensor s_rc = common::wgmma_acc_rowcol_view(state.s);
    // Warpgroup-local (row, col) of each score this thread holds, for the band mask.
    Tensor coords_rc =
        common::wgmma_acc_rowcol_view(ops.thr_mma_qk.partition_C(make_identity_tensor(Shape<WgRows, BlockN>{})));
    transform_and_mask_scores<kMasked, kSoftcap>(s_rc, coords_rc, transform, tile.mask,
                                                 tile.blocks.block_at(t) * kBlockN);
    if constexpr (kMaskMod && kMasked) {
      tile.bits.rows.template apply<kBlockN>(s_rc, coords_rc, tile.bits.m_start, tile.blocks.block_at(t) * kBlockN);
    }
    return s_rc;
  }

  // Block 0 of a tile whose S_0 has been computed into state.s: O cleared, a fresh softmax, P_0.
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void first_block_softmax(ConsumerState& state, Operands& ops, const ConsumerTile& tile,
                                             const common::ScoreTransform& transform, AccO& acc_o,
                                             Softmax& softmax) {
    cute::clear(acc_o);
    softmax = Softmax(transform.exp2_scale);
    float correction[Softmax::kNumRows];  // O is zero: nothing to rescale
    if (tile.blocks.num_masked() > 0) {
      auto s_rc = transformed_scores<true>(state, ops, tile, 0, transform);
      softmax.update(s_rc, correction);
    } else {
      auto s_rc = transformed_scores<false>(state, ops, tile, 0, transform);
      softmax.update(s_rc, correction);
    }
    common::convert_fragment_into(state.s, state.p);
  }

  // Block 0 of a tile when nothing is in flight (the CTA's first tile, or no second Q buffer to prefetch into).
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void first_block(TensorStorage& tensors, BarrierStorage& barriers, PipelineK& pipeline_k,
                                     ConsumerState& state, const ConsumerTile& tile, int warpgroup, int thread_in_wg,
                                     const common::ScoreTransform& transform, AccO& acc_o, Softmax& softmax) {
    using namespace cute;
    Operands ops(thread_in_wg);
    Tensor tSrQ = ops.q(tensors, tile.q_slot, warpgroup);
    Tensor tSrK = ops.k(tensors);
    if constexpr (kSkipIdle) {
      if (tile.idle) {
        pipeline_k.consumer_wait(state.read_k);
        release(pipeline_k, state.read_k);
        return;
      }
    }
    barriers.q[tile.q_slot.buffer].wait(tile.q_slot.phase);
    pipeline_k.consumer_wait(state.read_k);
    common::wgmma_gemm</*kZeroInit=*/true, /*kWaitGroups=*/0>(ops.mma_qk, tSrQ, tSrK(_, _, _, state.read_k.index()),
                                                              state.s);
    release(pipeline_k, state.read_k);
    first_block_softmax(state, ops, tile, transform, acc_o, softmax);
  }

  // Step t >= 1 of a tile (see above). Only warpgroup 0 polls the K and V full barriers: a later warpgroup is
  // granted its turn (ping_pong) only after the one before it waited for the same K and V stages and issued its
  // GEMMs, so the data has landed.
  template <bool kMasked, typename TQ, typename TK, typename TV, typename AccORC, typename AccO, typename Softmax>
  __device__ __forceinline__ static void steady_step(PipelineK& pipeline_k, PipelineV& pipeline_v,
                                                     ConsumerState& state, Operands& ops, TQ& tSrQ, TK& tSrK,
                                                     TV& tOrV, AccORC& acc_o_rc, const ConsumerTile& tile, int t,
                                                     int warpgroup, const common::ScoreTransform& transform,
                                                     AccO& acc_o, Softmax& softmax) {
    using namespace cute;
    const bool polls_stages = warpgroup == 0;
    take_turn(warpgroup);
    if (polls_stages) pipeline_k.consumer_wait(state.read_k);
    common::wgmma_gemm<true, -1>(ops.mma_qk, tSrQ, tSrK(_, _, _, state.read_k.index()), state.s);
    if (polls_stages) pipeline_v.consumer_wait(state.read_v);
    common::wgmma_gemm<false, -1>(ops.mma_pv, state.p, tOrV(_, _, _, state.read_v.index()), acc_o);
    pass_turn(warpgroup);

    warpgroup_wait<1>();  // S_t is complete; the PV GEMM may still run
    warpgroup_fence_operand(state.s);
    release(pipeline_k, state.read_k);
    Tensor s_rc = transformed_scores<kMasked>(state, ops, tile, t, transform);
    if constexpr (kExponentiateAtReference && !kMasked) {
      // P_t is written over P_{t-1}, the operand of the PV GEMM: wait for it first. (Only the conversion into P
      // must follow the wait: ptxas issues most of the FFMAs and a quarter of the exponentials before it, into
      // temporaries, as the library's SASS shows.)
      wait_for_pv(pipeline_v, state, acc_o);
      Tensor p_rc = make_tensor(state.p.data(), common::wgmma_acc_rowcol_layout(state.s.layout()));
      if (softmax.exponentiate_at_reference(s_rc, p_rc)) return;
      float correction[Softmax::kNumRows];  // rare: a row's max grew past the fast path's bound
      if (softmax.update(s_rc, correction)) Softmax::rescale_o(acc_o_rc, correction);
    } else {
      float correction[Softmax::kNumRows];
      const bool rescale = softmax.update(s_rc, correction);
      // Lets the softmax above overlap the PV GEMM. In the library's SASS (-DNDEBUG) ptxas keeps most of the
      // exponentials ahead of the wait at D 256; SASS compiled without -DNDEBUG had shown the wait near the start
      // of the softmax. Moving this wait, the rescale and the conversion to the start of the next GEMM turn
      // (across the loop's back edge) measured slower on the H200 (-1% at D 128, -10% at D 256; docs/performance.md).
      wait_for_pv(pipeline_v, state, acc_o);
      if (rescale) Softmax::rescale_o(acc_o_rc, correction);
    }
    common::convert_fragment_into(state.s, state.p);
  }

  // Waits for the warpgroup's PV GEMM (O and P are ours again) and releases its V stage.
  template <typename AccO>
  __device__ __forceinline__ static void wait_for_pv(PipelineV& pipeline_v, ConsumerState& state, AccO& acc_o) {
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(acc_o);
    cute::warpgroup_fence_operand(state.p);
    release(pipeline_v, state.read_v);
  }

  // Steps t = 1 .. n - 1 of a tile.
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void steady_blocks(TensorStorage& tensors, PipelineK& pipeline_k, PipelineV& pipeline_v,
                                       ConsumerState& state, const ConsumerTile& tile, int warpgroup,
                                       int thread_in_wg, const common::ScoreTransform& transform, AccO& acc_o,
                                       Softmax& softmax) {
    using namespace cute;
    Operands ops(thread_in_wg);
    Tensor tSrQ = ops.q(tensors, tile.q_slot, warpgroup);
    Tensor tSrK = ops.k(tensors);
    Tensor tOrV = ops.vt(tensors);
    Tensor acc_o_rc = common::wgmma_acc_rowcol_view(acc_o);
    const int num_blocks = tile.blocks.num_blocks();
    const int num_masked = tile.blocks.num_masked();
    if constexpr (kSkipIdle) {
      if (tile.idle) {  // the turns pace the releases: each stage is released after the turn that saw it land
        CUTE_NO_UNROLL
        for (int t = 1; t < num_blocks; ++t) {
          take_turn(warpgroup);
          if (warpgroup == 0) {
            pipeline_k.consumer_wait(state.read_k);
            pipeline_v.consumer_wait(state.read_v);
          }
          pass_turn(warpgroup);
          release(pipeline_k, state.read_k);
          release(pipeline_v, state.read_v);
        }
        return;
      }
    }
    CUTE_NO_UNROLL
    for (int t = 1; t < num_masked; ++t) {
      steady_step<true>(pipeline_k, pipeline_v, state, ops, tSrQ, tSrK, tOrV, acc_o_rc, tile, t, warpgroup, transform,
                        acc_o, softmax);
    }
    CUTE_NO_UNROLL
    for (int t = num_masked > 1 ? num_masked : 1; t < num_blocks; ++t) {
      steady_step<false>(pipeline_k, pipeline_v, state, ops, tSrQ, tSrK, tOrV, acc_o_rc, tile, t, warpgroup,
                         transform, acc_o, softmax);
    }
  }

  // The tile's last PV GEMM, on the warpgroup's turn. Returns with acc_o complete (the kernel's epilogue reads it).
  // An idle warpgroup (kSkipIdle) issues it too, on stale P into an O that is never stored, here and in
  // tail_and_prefetch (with the next tile's S_0): a GEMM issued under a run-time condition makes ptxas serialize
  // every wgmma of the kernel (C7514 / C7515: each waited on before the next is issued), which cost the steady
  // steps of the warpgroups that do work far more than one block's GEMMs per tile.
  template <typename AccO>
  __device__ __forceinline__ static void tail(TensorStorage& tensors, PipelineV& pipeline_v, ConsumerState& state,
                                              int warpgroup, int thread_in_wg, AccO& acc_o) {
    using namespace cute;
    Operands ops(thread_in_wg);
    Tensor tOrV = ops.vt(tensors);
    take_turn(warpgroup);
    pipeline_v.consumer_wait(state.read_v);
    common::wgmma_gemm<false, -1>(ops.mma_pv, state.p, tOrV(_, _, _, state.read_v.index()), acc_o);
    pass_turn(warpgroup);
    wait_for_pv(pipeline_v, state, acc_o);
  }

  // tail(), and in the same turn S_0 = Q K_0^T of the next tile, left in flight (kCanPrefetchQuery: the next
  // tile's Q has a buffer of its own). finish_prefetch then takes S_0.
  template <typename AccO>
  __device__ __forceinline__ static void tail_and_prefetch(TensorStorage& tensors, BarrierStorage& barriers,
                                                           PipelineK& pipeline_k, PipelineV& pipeline_v,
                                                           ConsumerState& state, const ConsumerTile& next,
                                                           int warpgroup, int thread_in_wg, AccO& acc_o) {
    using namespace cute;
    static_assert(kCanPrefetchQuery);
    Operands ops(thread_in_wg);
    Tensor tOrV = ops.vt(tensors);
    Tensor tSrQ = ops.q(tensors, next.q_slot, warpgroup);
    Tensor tSrK = ops.k(tensors);
    take_turn(warpgroup);
    pipeline_v.consumer_wait(state.read_v);
    common::wgmma_gemm<false, -1>(ops.mma_pv, state.p, tOrV(_, _, _, state.read_v.index()), acc_o);
    barriers.q[next.q_slot.buffer].wait(next.q_slot.phase);
    pipeline_k.consumer_wait(state.read_k);
    common::wgmma_gemm<true, -1>(ops.mma_qk, tSrQ, tSrK(_, _, _, state.read_k.index()), state.s);
    pass_turn(warpgroup);
    warpgroup_wait<1>();  // the PV GEMM is complete; S_0 may still run
    warpgroup_fence_operand(acc_o);
    warpgroup_fence_operand(state.p);
    release(pipeline_v, state.read_v);
  }

  // The next tile's S_0, issued by tail_and_prefetch(): wait for it, then as first_block.
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void finish_prefetch(PipelineK& pipeline_k, ConsumerState& state, const ConsumerTile& tile,
                                         int thread_in_wg, const common::ScoreTransform& transform, AccO& acc_o,
                                         Softmax& softmax) {
    using namespace cute;
    Operands ops(thread_in_wg);
    warpgroup_wait<0>();
    warpgroup_fence_operand(state.s);
    release(pipeline_k, state.read_k);
    if (kSkipIdle && tile.idle) return;
    first_block_softmax(state, ops, tile, transform, acc_o, softmax);
  }
};

}  // namespace flashjax::sm90

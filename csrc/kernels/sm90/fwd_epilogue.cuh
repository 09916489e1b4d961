// Epilogue of the sm90 forward kernel, per consumer warpgroup (64 rows): the normalized O goes registers ->
// shared memory (the warpgroup's half of the staging buffer, via stmatrix) -> global by one TMA store; each row's
// LSE is stored directly by the lane holding its first column. The staging buffer is a buffer of its own where
// shared memory allows (FwdKernelSm90::kOwnOBuffer), else the Q buffer.
//
// Ragged tiles need no separate path: the O descriptor spans (Sq, D, Hq, B), and TMA stores only the elements of a
// box that lie inside those bounds, so rows past Sq are dropped without touching the next head's rows. (A packed
// varlen layout, where rows past one sequence belong to the next, will need predicated stores instead.) A tile of
// packed GQA (fwd_query_tiling.cuh) stores one box per 8-row chunk, each at its own position and query head; its
// LSE, like every tile's, goes out per row.
//
// Shared-memory hand-offs, in order:
//   own buffer: the previous tile's TMA store has finished reading it (the wait at the top of store());
//   Q buffer: the warpgroup's last wgmma reading its Q half has been waited on (end of the mainloop);
//   then generic-proxy writes; fence.proxy.async makes them visible to the TMA (async proxy) store;
//   Q buffer only: the issuing thread waits until the store has read shared memory, and the warpgroup syncs,
//   before anyone tells the producer (QueryEmpty) that the next Q may land there.
// Tiles without any visible key (store_empty) write zeros straight to global memory: they take no part in the Q
// hand-off, so they must not touch the Q buffer, which the producer may be filling for the next tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashjax/params.h"

#include "kernels/sm90/fwd_named_barriers.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

template <typename Mainloop>
struct FwdEpilogueSm90 {
  using Element = typename Mainloop::Element;
  using WgRows = typename Mainloop::WgRows;
  using HeadDim = typename Mainloop::HeadDim;
  using SmemLayoutO = typename Mainloop::SmemLayoutQHalf;
  static constexpr int kRowsPerWarpgroup = Mainloop::kRowsPerWarpgroup;
  static constexpr int kConsumerWarpgroups = Mainloop::kConsumerWarpgroups;

  using GmemTensorO = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)),
                                                 typename Mainloop::ShapeSDHB{}, typename Mainloop::StrideSDHB{}));
  using TmaO = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorO{}, SmemLayoutO{},
                                            cute::Shape<WgRows, HeadDim>{}, cute::_1{}));
  using QueryTiling = typename Mainloop::QueryTiling;
  using Row = typename QueryTiling::Row;
  static constexpr int kChunkRows = Mainloop::kChunkRows;
  using TmaOChunk = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensorO{},
                                                 typename Mainloop::SmemLayoutQChunk{},
                                                 cute::Shape<cute::Int<kChunkRows>, HeadDim>{}, cute::_1{}));
  // stmatrix writes 16-byte rows of 8x8 tiles, matching the accumulator's quad layout without bank conflicts.
  using SmemCopyAtomO = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  struct Arguments {
    Element* o;
    typename Mainloop::ShapeSDHB shape_o;  // (Sq, D, Hq, B)
    typename Mainloop::StrideSDHB stride_o;
    float* lse;  // [B, Hq, Sq], row stride 1; nullptr: not requested
    int64_t lse_batch_stride, lse_head_stride;
  };

  struct Params {
    TmaO tma_o;
    TmaOChunk tma_o_chunk;  // Mainloop::kPackGqa only
    typename Mainloop::ShapeSDHB shape_o;
    typename Mainloop::StrideSDHB stride_o;  // and the raw pointer: store_empty writes without TMA
    Element* o;
    float* lse;
    int64_t lse_batch_stride, lse_head_stride;
  };

  static Params to_params(const Arguments& args) {
    using namespace cute;
    Tensor m_o = make_tensor(make_gmem_ptr(args.o), args.shape_o, args.stride_o);
    Params params{make_tma_copy(SM90_TMA_STORE{}, m_o, SmemLayoutO{}, Shape<WgRows, HeadDim>{}, _1{}),
                  TmaOChunk{},
                  args.shape_o,
                  args.stride_o,
                  args.o,
                  args.lse,
                  args.lse_batch_stride,
                  args.lse_head_stride};
    if constexpr (Mainloop::kPackGqa) {
      params.tma_o_chunk = make_tma_copy(SM90_TMA_STORE{}, m_o, typename Mainloop::SmemLayoutQChunk{},
                                         Shape<Int<kChunkRows>, HeadDim>{}, _1{});
    }
    return params;
  }

  // The call's O and LSE (FwdParams: O [B, Sq, Hq, D] with its strides, LSE [B, Hq, Sq]).
  static Params to_params(const FwdParams& params) {
    return to_params(Arguments{static_cast<Element*>(params.o),
                               {params.seqlen_q, Mainloop::kHeadDim, params.heads_q, params.batch},
                               {params.o_row_stride, cute::_1{}, params.o_head_stride, params.o_batch_stride},
                               params.lse,
                               params.lse_batch_stride,
                               params.lse_head_stride});
  }

  __device__ static void prefetch_tma_descriptors(const Params& params) {
    cute::prefetch_tma_descriptor(Mainloop::kPackGqa ? params.tma_o_chunk.get_tma_descriptor()
                                                     : params.tma_o.get_tma_descriptor());
  }

  // acc_o: this thread's normalized 64 x D accumulator; lse: its rows' LSE in the accumulator's row order;
  // smem_o: the staging buffer's base (64-row halves of SmemLayoutO), kOwnBuffer: whether it is not the Q buffer;
  // (m_block, head, batch): the scheduler's tile.
  template <bool kOwnBuffer, typename AccO, int kRows>
  __device__ static void store(const Params& params, Element* smem_o, const AccO& acc_o, const float (&lse)[kRows],
                               const QueryTiling& tiling, int warpgroup, int thread_in_wg, int m_block, int head,
                               int batch) {
    using namespace cute;
    typename Mainloop::TiledMmaPV mma_pv;
    Tensor s_o = make_tensor(make_smem_ptr(smem_o + warpgroup * Mainloop::kQHalfElems), SmemLayoutO{});

    Tensor r_o = make_tensor<Element>(acc_o.layout());
    common::convert_fragment_into(acc_o, r_o);
    if constexpr (kOwnBuffer) {
      // The previous tile's store was left in flight; it must have read the buffer before it is overwritten.
      if (thread_in_wg == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, FwdNamedBarrier::epilogue(warpgroup));
    }
    auto smem_copy_o = make_tiled_copy_C(SmemCopyAtomO{}, mma_pv);
    auto thr_copy_o = smem_copy_o.get_thread_slice(thread_in_wg);
    copy(smem_copy_o, thr_copy_o.retile_S(r_o), thr_copy_o.partition_D(s_o));
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, FwdNamedBarrier::epilogue(warpgroup));

    if (thread_in_wg == 0) {
      if constexpr (!Mainloop::kPackGqa) {
        Tensor m_o = params.tma_o.get_tma_tensor(params.shape_o)(_, _, head, batch);
        Tensor g_o = local_tile(m_o, Shape<WgRows, HeadDim>{},
                                make_coord(m_block * kConsumerWarpgroups + warpgroup, _0{}));
        auto tma_o = params.tma_o.get_slice(_0{});
        copy(params.tma_o, tma_o.partition_S(s_o), tma_o.partition_D(g_o));
      } else {
        store_chunks(params, smem_o + warpgroup * Mainloop::kQHalfElems, tiling, warpgroup, m_block, head, batch);
      }
      tma_store_arrive();
    }
    store_lse(params, lse, tiling, warpgroup, thread_in_wg, m_block, head, batch);

    if constexpr (!kOwnBuffer) {
      if (thread_in_wg == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, FwdNamedBarrier::epilogue(warpgroup));
    }
  }

  // A tile none of whose rows sees a key: O = 0 written with plain 16-byte stores (rows past Sq skipped), the LSE
  // as finalize() computed it (-inf, or the sink).
  template <int kRows>
  __device__ static void store_empty(const Params& params, const float (&lse)[kRows], const QueryTiling& tiling,
                                     int warpgroup, int thread_in_wg, int m_block, int head, int batch) {
    using namespace cute;
    constexpr int kVecElems = 16 / sizeof(Element);
    constexpr int kVecsPerRow = Mainloop::kHeadDim / kVecElems;
    static_assert(Mainloop::kHeadDim % kVecElems == 0);
    const int seqlen_q = get<0>(params.shape_o);
    Element* o_batch = params.o + batch * get<3>(params.stride_o);
    for (int i = thread_in_wg; i < kRowsPerWarpgroup * kVecsPerRow; i += 128) {
      const int tile_row = warpgroup * kRowsPerWarpgroup + i / kVecsPerRow;
      if constexpr (Mainloop::kPackGqa) {
        const Row row = tiling.row(m_block, head, tile_row);
        if (row.position < seqlen_q) {
          Element* o_row = o_batch + row.head_q * get<2>(params.stride_o) + row.position * get<0>(params.stride_o);
          *reinterpret_cast<uint4*>(o_row + (i % kVecsPerRow) * kVecElems) = make_uint4(0, 0, 0, 0);
        }
      } else {  // one head's consecutive rows: its offset out of the loop (see store_lse)
        const int row = m_block * Mainloop::kBlockM + tile_row;
        Element* o_head = o_batch + head * get<2>(params.stride_o);
        if (row < seqlen_q) {
          *reinterpret_cast<uint4*>(o_head + row * get<0>(params.stride_o) + (i % kVecsPerRow) * kVecElems) =
              make_uint4(0, 0, 0, 0);
        }
      }
    }
    store_lse(params, lse, tiling, warpgroup, thread_in_wg, m_block, head, batch);
  }

  // Call once before the CTA exits: a TMA store still reading shared memory must finish first.
  __device__ static void drain(int thread_in_wg) {
    if (thread_in_wg == 0) cute::tma_store_wait<0>();
  }

 private:
  // The warpgroup's 8 chunks of a packed tile, from its half of the staging buffer (s_o): one TMA store each, at
  // the chunk's position and query head. Chunks past the last position (the group's last tile) are skipped.
  __device__ static void store_chunks(const Params& params, Element* s_o, const QueryTiling& tiling, int warpgroup,
                                      int m_block, int head, int batch) {
    using namespace cute;
    constexpr int kChunksPerHalf = Mainloop::kChunksPerHalf;
    auto tma_o = params.tma_o_chunk.get_slice(_0{});
    Tensor m_o = params.tma_o_chunk.get_tma_tensor(params.shape_o);  // (Sq, D, Hq, B)
    const int first_chunk = m_block * QueryTiling::kChunksPerTile + warpgroup * kChunksPerHalf;
    CUTE_NO_UNROLL
    for (int j = 0; j < kChunksPerHalf; ++j) {
      const Row chunk = tiling.chunk(first_chunk + j, head);
      if (chunk.position >= get<0>(params.shape_o)) break;  // chunks only grow in position
      Tensor g_chunk = local_tile(m_o(_, _, chunk.head_q, batch), Shape<Int<kChunkRows>, HeadDim>{},
                                  make_coord(chunk.position / kChunkRows, _0{}));
      Tensor s_chunk =
          make_tensor(make_smem_ptr(s_o + j * Mainloop::kQChunkElems), typename Mainloop::SmemLayoutQChunk{});
      copy(params.tma_o_chunk, tma_o.partition_S(s_chunk), tma_o.partition_D(g_chunk));
    }
  }

  // Each row's LSE, by the lane of its quad that holds column 0. Unpacked, the rows are one head's consecutive
  // positions, and the code is the one from before packing existed: the head's offset is taken once, in uniform
  // registers. (With per-row addresses shared by both paths, the unpacked D 128 rows read 1-2% slower in an A/B on
  // the H200, not separated from the order of the builds; the per-tile path runs between two tiles' GEMMs:
  // docs/performance.md.)
  template <int kRows>
  __device__ static void store_lse(const Params& params, const float (&lse)[kRows], const QueryTiling& tiling,
                                   int warpgroup, int thread_in_wg, int m_block, int head, int batch) {
    using namespace cute;
    if (params.lse == nullptr) return;
    typename Mainloop::TiledMmaPV mma_pv;
    const int seqlen_q = get<0>(params.shape_o);
    auto thr_mma = mma_pv.get_thread_slice(thread_in_wg);
    Tensor tOcO_rc =
        common::wgmma_acc_rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<WgRows, HeadDim>{})));
    if (get<1>(tOcO_rc(0, 0)) != 0) return;
    if constexpr (Mainloop::kPackGqa) {
      float* lse_batch = params.lse + batch * params.lse_batch_stride;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const Row row = tiling.row(m_block, head, warpgroup * kRowsPerWarpgroup + get<0>(tOcO_rc(r, 0)));
        if (row.position < seqlen_q) lse_batch[row.head_q * params.lse_head_stride + row.position] = lse[r];
      }
    } else {
      const int row_start = (m_block * kConsumerWarpgroups + warpgroup) * kRowsPerWarpgroup;
      float* lse_rows = params.lse + batch * params.lse_batch_stride + head * params.lse_head_stride;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = row_start + get<0>(tOcO_rc(r, 0));
        if (row < seqlen_q) lse_rows[row] = lse[r];
      }
    }
  }
};

}  // namespace flashjax::sm90

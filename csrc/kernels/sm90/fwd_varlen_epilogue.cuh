// Epilogue of the sm90 forward for packed sequences (varlen, fwd_varlen_scheduler.cuh), per consumer warpgroup (64
// rows). In a packed tensor the rows past a sequence's used rows belong to the next sequence (or are its unused
// rows), so a whole-box TMA store, which clips only at the tensor's end, would overwrite them. Instead O goes
// registers -> shared memory (stmatrix, into the staging buffer as FwdEpilogueSm90 does) -> global by 16-byte stores
// of the warpgroup's threads, predicated by the sequence's used rows; LSE ([Hq, Tq]) per row, likewise predicated.
// Rows no tile writes (past seqused, past cu_seqlens_q[N]) are fwd_varlen_fill_unwritten_kernel's. Packed GQA
// (Mainloop::kPackGqa): a tile's row r is position tiling.row(r).position of query head tiling.row(r).head_q, within
// the tile's sequence (the tiling's chunks of 8 positions per head); rows at positions past the sequence's used rows
// are not stored.
//
// Shared-memory hand-offs: the staging buffer is read back by the same warpgroup's threads with plain loads, so a
// named barrier after the stmatrix writes (every thread's fragment visible to every reader) and one before the
// buffer is reused suffice: with O's own buffer that is the sync at the top of the next store(); with O staged in
// the Q buffer the sync at the end, after which the kernel frees the buffer for the next Q. Nothing is in flight
// when the CTA exits (drain() is empty).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashjax/params.h"
#include "kernels/sm90/fwd_named_barriers.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

template <typename Mainloop>
struct FwdVarlenEpilogueSm90 {
  using Element = typename Mainloop::Element;
  using WgRows = typename Mainloop::WgRows;
  using HeadDim = typename Mainloop::HeadDim;
  using SmemLayoutO = typename Mainloop::SmemLayoutQHalf;
  static constexpr int kHeadDim = Mainloop::kHeadDim;
  static constexpr int kRowsPerWarpgroup = Mainloop::kRowsPerWarpgroup;
  using QueryTiling = typename Mainloop::QueryTiling;
  // 16-byte vectors: the wgmma shared layouts swizzle in 16-byte units, so 8 consecutive columns of a row starting
  // at a multiple of 8 are one contiguous, aligned vector in the staging buffer as in global memory.
  static constexpr int kVecElems = 16 / sizeof(Element);
  static constexpr int kVecsPerRow = kHeadDim / kVecElems;
  static_assert(kHeadDim % kVecElems == 0);
  using SmemCopyAtomO = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  struct Params {
    Element* o;  // [Tq, Hq, D]
    int64_t o_row_stride, o_head_stride;
    float* lse;  // [Hq, Tq]; nullptr: not requested
    int64_t lse_head_stride;
  };

  static Params to_params(const FwdParams& params) {
    return {static_cast<Element*>(params.o), params.o_row_stride, params.o_head_stride, params.lse,
            params.lse_head_stride};
  }

  __device__ static void prefetch_tma_descriptors(const Params&) {}
  __device__ static void drain(int) {}

  // As FwdEpilogueSm90::store, for the varlen scheduler's tile (its sequence's rows): acc_o this thread's
  // normalized 64 x D accumulator, lse its rows' LSE in the accumulator's row order, smem_o the staging buffer's
  // base, kOwnBuffer whether it is not the Q buffer.
  template <bool kOwnBuffer, typename AccO, int kRows, typename Tile>
  __device__ static void store(const Params& params, Element* smem_o, const AccO& acc_o, const float (&lse)[kRows],
                               const QueryTiling& tiling, int warpgroup, int thread_in_wg, const Tile& tile) {
    using namespace cute;
    typename Mainloop::TiledMmaPV mma_pv;
    Tensor s_o = make_tensor(make_smem_ptr(smem_o + warpgroup * Mainloop::kQHalfElems), SmemLayoutO{});
    Tensor r_o = make_tensor<Element>(acc_o.layout());
    common::convert_fragment_into(acc_o, r_o);
    // Own buffer: every thread has finished reading the previous tile's O out of it (program order before this
    // barrier). Q buffer: the warpgroup's last wgmma reading it was waited on by the mainloop.
    if constexpr (kOwnBuffer) cutlass::arch::NamedBarrier::sync(128, FwdNamedBarrier::epilogue(warpgroup));
    auto smem_copy_o = make_tiled_copy_C(SmemCopyAtomO{}, mma_pv);
    auto thr_copy_o = smem_copy_o.get_thread_slice(thread_in_wg);
    copy(smem_copy_o, thr_copy_o.retile_S(r_o), thr_copy_o.partition_D(s_o));
    cutlass::arch::NamedBarrier::sync(128, FwdNamedBarrier::epilogue(warpgroup));

    if constexpr (Mainloop::kPackGqa) {
      for (int i = thread_in_wg; i < kRowsPerWarpgroup * kVecsPerRow; i += 128) {
        const int row = i / kVecsPerRow, col = (i % kVecsPerRow) * kVecElems;
        Element* o_row = packed_row(params, tiling, tile, warpgroup * kRowsPerWarpgroup + row);
        if (o_row != nullptr) *reinterpret_cast<uint4*>(o_row + col) = *reinterpret_cast<const uint4*>(&s_o(row, col));
      }
    } else {
      const int first_row = tile.m_block * Mainloop::kBlockM + warpgroup * kRowsPerWarpgroup;  // in the sequence
      const int rows = min(tile.seqlen_q - first_row, kRowsPerWarpgroup);
      Element* o_rows = params.o + (int64_t(tile.q_start) + first_row) * params.o_row_stride +
                        tile.head * params.o_head_stride;
      for (int i = thread_in_wg; i < rows * kVecsPerRow; i += 128) {
        const int row = i / kVecsPerRow, col = (i % kVecsPerRow) * kVecElems;
        *reinterpret_cast<uint4*>(o_rows + row * params.o_row_stride + col) =
            *reinterpret_cast<const uint4*>(&s_o(row, col));
      }
    }
    store_lse(params, lse, tiling, warpgroup, thread_in_wg, tile);
    // O staged in the Q buffer: every thread's reads are done before the kernel frees it for the next Q.
    if constexpr (!kOwnBuffer) cutlass::arch::NamedBarrier::sync(128, FwdNamedBarrier::epilogue(warpgroup));
  }

  // A tile none of whose rows sees a key (the sequence's used keys are none, or a window leaves its rows empty):
  // O = 0 in its used rows, LSE as finalize() computed it (-inf, or the sink). No shared memory.
  template <int kRows, typename Tile>
  __device__ static void store_empty(const Params& params, const float (&lse)[kRows], const QueryTiling& tiling,
                                     int warpgroup, int thread_in_wg, const Tile& tile) {
    if constexpr (Mainloop::kPackGqa) {
      for (int i = thread_in_wg; i < kRowsPerWarpgroup * kVecsPerRow; i += 128) {
        Element* o_row = packed_row(params, tiling, tile, warpgroup * kRowsPerWarpgroup + i / kVecsPerRow);
        if (o_row != nullptr) *reinterpret_cast<uint4*>(o_row + (i % kVecsPerRow) * kVecElems) = make_uint4(0, 0, 0, 0);
      }
    } else {
      const int first_row = tile.m_block * Mainloop::kBlockM + warpgroup * kRowsPerWarpgroup;
      const int rows = min(tile.seqlen_q - first_row, kRowsPerWarpgroup);
      Element* o_rows = params.o + (int64_t(tile.q_start) + first_row) * params.o_row_stride +
                        tile.head * params.o_head_stride;
      for (int i = thread_in_wg; i < rows * kVecsPerRow; i += 128) {
        *reinterpret_cast<uint4*>(o_rows + (i / kVecsPerRow) * params.o_row_stride + (i % kVecsPerRow) * kVecElems) =
            make_uint4(0, 0, 0, 0);
      }
    }
    store_lse(params, lse, tiling, warpgroup, thread_in_wg, tile);
  }

 private:
  // Packed GQA: O's row in global memory of the tile's row tile_row (0..kBlockM), nullptr where its position lies
  // past the sequence's used rows.
  template <typename Tile>
  __device__ static Element* packed_row(const Params& params, const QueryTiling& tiling, const Tile& tile,
                                        int tile_row) {
    const auto row = tiling.row(tile.m_block, tile.head, tile_row);
    if (row.position >= tile.seqlen_q) return nullptr;
    return params.o + (int64_t(tile.q_start) + row.position) * params.o_row_stride +
           int64_t(row.head_q) * params.o_head_stride;
  }

  // Each used row's LSE, by the lane of its quad that holds column 0.
  template <int kRows, typename Tile>
  __device__ static void store_lse(const Params& params, const float (&lse)[kRows], const QueryTiling& tiling,
                                   int warpgroup, int thread_in_wg, const Tile& tile) {
    using namespace cute;
    if (params.lse == nullptr) return;
    typename Mainloop::TiledMmaPV mma_pv;
    auto thr_mma = mma_pv.get_thread_slice(thread_in_wg);
    Tensor tOcO_rc =
        common::wgmma_acc_rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<WgRows, HeadDim>{})));
    if (get<1>(tOcO_rc(0, 0)) != 0) return;
    if constexpr (Mainloop::kPackGqa) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const auto row = tiling.row(tile.m_block, tile.head, warpgroup * kRowsPerWarpgroup + get<0>(tOcO_rc(r, 0)));
        if (row.position < tile.seqlen_q) {
          params.lse[int64_t(row.head_q) * params.lse_head_stride + tile.q_start + row.position] = lse[r];
        }
      }
    } else {
      const int first_row = tile.m_block * Mainloop::kBlockM + warpgroup * kRowsPerWarpgroup;
      float* lse_rows = params.lse + tile.head * params.lse_head_stride + tile.q_start;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = first_row + get<0>(tOcO_rc(r, 0));
        if (row < tile.seqlen_q) lse_rows[row] = lse[r];
      }
    }
  }
};

}  // namespace flashjax::sm90

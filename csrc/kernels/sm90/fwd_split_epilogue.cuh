// Epilogue of the split-keys sm90 forward kernel (fwd_split_kv.h): each tile is one part of a query tile's KV
// range, and writes its rows' O (f32, normalized by the part's own sum) and LSE (without the sink, which the combine
// adds once) straight from registers to the workspace, [B, num_splits, Hq, Sq, D] and [B, num_splits, Hq, Sq].
// fwd_split_combine.cuh merges the parts into O and LSE.
//
// The part is folded into the scheduler's batch coordinate (walk batch = batch * num_splits + part), which is also
// the workspace's leading index: the epilogue needs no decoding, and the kernel decodes the walk batch only to load
// K/V (batch_of) and to cut the tile's KV range (part_of). The interface is FwdEpilogueSm90's; there is no shared
// memory staging and nothing in flight to drain. Decode-sized calls only (the rule splits where tiles fill at most
// half of the SMs), so plain per-element stores are cheap enough.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/fast_math.h>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

template <typename Mainloop>
struct FwdSplitEpilogueSm90 {
  using Element = typename Mainloop::Element;
  using WgRows = typename Mainloop::WgRows;
  using HeadDim = typename Mainloop::HeadDim;
  using QueryTiling = typename Mainloop::QueryTiling;
  using Row = typename QueryTiling::Row;
  static constexpr int kHeadDim = Mainloop::kHeadDim;
  static constexpr int kRowsPerWarpgroup = Mainloop::kRowsPerWarpgroup;
  static_assert(Mainloop::kPackGqa, "the split kernel walks packed tiles (any group, 1 included)");

  struct Params {
    float* o_partial;
    float* lse_partial;
    int seqlen_q, heads_q;
    int num_splits;
    cutlass::FastDivmod splits_divmod;

    // The call's batch of a walk batch, and the part of a tile's KV range it runs.
    __device__ int batch_of(int walk_batch) const {
      int batch, part;
      splits_divmod(batch, part, walk_batch);
      return batch;
    }
    __device__ common::KvBlockRange part_of(const common::KvBlockRange& blocks, int walk_batch) const {
      int batch, part;
      splits_divmod(batch, part, walk_batch);
      return blocks.part(part, num_splits);
    }
  };

  static Params to_params(const FwdParams& params) {
    return {params.o_partial, params.lse_partial, params.seqlen_q, params.heads_q, params.num_splits,
            cutlass::FastDivmod(params.num_splits)};
  }

  __device__ static void prefetch_tma_descriptors(const Params&) {}
  __device__ static void drain(int) {}

  // acc_o: this thread's normalized 64 x D accumulator; lse: its rows' LSE in the accumulator's row order;
  // (m_block, head, walk_batch): the scheduler's tile. The staging buffer is not used.
  template <bool kOwnBuffer, typename AccO, int kRows>
  __device__ static void store(const Params& params, Element*, const AccO& acc_o, const float (&lse)[kRows],
                               const QueryTiling& tiling, int warpgroup, int thread_in_wg, int m_block, int head,
                               int walk_batch) {
    using namespace cute;
    typename Mainloop::TiledMmaPV mma_pv;
    auto thr_mma = mma_pv.get_thread_slice(thread_in_wg);
    Tensor coords = common::wgmma_acc_rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<WgRows, HeadDim>{})));
    Tensor acc_rc = common::wgmma_acc_rowcol_view(acc_o);
    static_assert(decltype(size<0>(coords))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const Row row = tiling.row(m_block, head, warpgroup * kRowsPerWarpgroup + get<0>(coords(r, 0)));
      if (row.position >= params.seqlen_q) continue;
      const int64_t row_index = (int64_t(walk_batch) * params.heads_q + row.head_q) * params.seqlen_q + row.position;
      float* o_row = params.o_partial + row_index * kHeadDim;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(coords); ++c) o_row[get<1>(coords(r, c))] = acc_rc(r, c);
      if (get<1>(coords(r, 0)) == 0) params.lse_partial[row_index] = lse[r];
    }
  }

  // A part none of whose rows sees a key (the tile's range is shorter than num_splits, or the rows see none at
  // all): O = 0 and the LSE finalize() computed (-inf: the split kernel leaves sinks to the combine).
  template <int kRows>
  __device__ static void store_empty(const Params& params, const float (&lse)[kRows], const QueryTiling& tiling,
                                     int warpgroup, int thread_in_wg, int m_block, int head, int walk_batch) {
    constexpr int kVecsPerRow = kHeadDim / 4;
    for (int i = thread_in_wg; i < kRowsPerWarpgroup * kVecsPerRow; i += 128) {
      const Row row = tiling.row(m_block, head, warpgroup * kRowsPerWarpgroup + i / kVecsPerRow);
      if (row.position >= params.seqlen_q) continue;
      const int64_t row_index = (int64_t(walk_batch) * params.heads_q + row.head_q) * params.seqlen_q + row.position;
      reinterpret_cast<float4*>(params.o_partial + row_index * kHeadDim)[i % kVecsPerRow] = make_float4(0, 0, 0, 0);
      if (i % kVecsPerRow == 0) params.lse_partial[row_index] = lse[0];
    }
  }
};

}  // namespace flashjax::sm90

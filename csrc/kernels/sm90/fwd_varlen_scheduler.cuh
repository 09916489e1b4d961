// Persistent tile scheduler of the sm90 forward for packed sequences (varlen, docs/design.md §2.7), and the fill of
// the query rows none of its tiles writes.
//
// Tiles are (virtual query block, query head) pairs, virtual blocks fastest: per head, varlen_num_blocks(Tq, N,
// kBlockM) of them (kernels/common/varlen.cuh: sequence b's blocks start at cu_seqlens_q[b] / kBlockM + b), so the
// walk covers the batch's real blocks plus at most one per sequence, never N x max_seqlen, and only the static
// shapes (Tq, N, Hq) size it: no compile and no host plan depends on the packing. CTAs take positions round robin
// (c, c + grid, ...) like the dense scheduler's unpaired walk; consecutive positions are neighbouring blocks of one
// head, so the CTAs resident at any moment share K/V in L2. A tile resolves its sequence on the device by binary
// search (every warp that walks it: the producer's two and each consumer warpgroup), reading offsets that stay in
// L1 after the first tile.
//
// A tile's rows and keys are its sequence's used ones, clamped (varlen_rows): whatever cu_seqlens / seqused hold,
// the tile's loads start inside the tensors and its stores (predicated by the used rows) never leave its sequence.
// A virtual block past its sequence's used rows has no work at all: no load, no store.
//
// Which rows no tile writes: the rows past a sequence's seqused, the tokens past cu_seqlens_q[N], and rows that
// malformed offsets leave out. fwd_varlen_fill_unwritten_kernel gives exactly those rows what the reference gives
// unused rows (out = 0, lse = -inf), deciding per row by the same functions the tiles use (row_written), so the two
// write disjoint rows and every row is written once: no memset of O ahead of the kernel (at 32k tokens, H 16, D 128
// that pass alone would be 134 MB of writes, a quarter of the forward's time for 64 sequences of 1..1024 tokens).
#pragma once

#include <cuda_runtime.h>
#include <cutlass/fast_math.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "flashjax/params.h"
#include "kernels/common/varlen.cuh"

namespace flashjax::sm90 {

template <int kBlockM>
struct FwdVarlenTileSchedulerSm90 {
  struct Params {
    int num_blocks;  // virtual query blocks per head (the walk's m-blocks)
    int heads;       // Hq
    int num_tiles;   // num_blocks * heads, or -1 where that overflows int32
    int grid;        // CTAs to launch
    cutlass::FastDivmod blocks_divmod;
    const int32_t* cu_seqlens_q;
    const int32_t* cu_seqlens_k;
    const int32_t* seqused_q;  // nullptr: every row of the slot
    const int32_t* seqused_k;
    int num_seqs;  // N >= 1 (the launcher launches nothing for N = 0)
    int total_q;   // Tq
    int total_k;   // Tk
  };

  // The tile's query head and virtual block, and its sequence's used rows in the packed tensors: query rows
  // [q_start, q_start + seqlen_q), keys [k_start, k_start + seqlen_k). m_block is the block within the sequence;
  // m_block * kBlockM >= seqlen_q: no work (has_rows()).
  struct Tile {
    int m_block;
    int head;
    int batch;  // always 0: the packed tensors are one batch
    int q_start, k_start;
    int seqlen_q, seqlen_k;
    __host__ __device__ bool has_rows() const { return m_block * kBlockM < seqlen_q; }
  };

  // tiling: the unpacked FwdQueryTiling (varlen tiles hold one query head's rows).
  template <typename QueryTiling>
  static Params to_params(const AttnShape& shape, const QueryTiling&, int num_sms) {
    Params params{};
    const int64_t num_blocks = shape.num_seqs > 0 ? common::varlen_num_blocks(shape.seqlen_q, shape.num_seqs, kBlockM)
                                                  : 0;
    const int64_t num_tiles = num_blocks * shape.heads_q;
    params.num_blocks = static_cast<int>(num_blocks);
    params.heads = shape.heads_q;
    params.num_tiles = num_tiles > INT_MAX ? -1 : static_cast<int>(num_tiles);
    params.grid = static_cast<int>(num_tiles < num_sms ? num_tiles : num_sms);
    params.blocks_divmod = cutlass::FastDivmod(num_blocks > 0 ? params.num_blocks : 1);
    params.cu_seqlens_q = shape.cu_seqlens_q;
    params.cu_seqlens_k = shape.cu_seqlens_k;
    params.seqused_q = shape.seqused_q;
    params.seqused_k = shape.seqused_k;
    params.num_seqs = shape.num_seqs;
    params.total_q = shape.seqlen_q;
    params.total_k = shape.seqlen_k;
    return params;
  }

  static int grid_size(const Params& params) { return params.num_tiles > 0 ? params.grid : 0; }

  __host__ __device__ static int first_tile(const Params& params, int cta) {
    return cta < params.num_tiles ? cta : params.num_tiles;
  }
  __host__ __device__ static int next_tile(const Params& params, int position, int, int grid) {
    const int next = position + grid;
    return next < params.num_tiles ? next : params.num_tiles;
  }

  // position in [0, num_tiles). The offsets must be readable where it runs (the device; the host in
  // tests/cpp/test_varlen_scheduler.cu).
  __host__ __device__ static Tile tile(const Params& params, int position) {
    int head, virtual_block;
    params.blocks_divmod(head, virtual_block, position);
    const common::VarlenBlock found =
        common::varlen_block<kBlockM>(params.cu_seqlens_q, params.num_seqs, params.total_q, virtual_block);
    const common::VarlenRows q = common::varlen_rows(params.cu_seqlens_q, params.seqused_q, found.seq, params.total_q);
    const common::VarlenRows k = common::varlen_rows(params.cu_seqlens_k, params.seqused_k, found.seq, params.total_k);
    // A block before its sequence's start (a not-from-zero or non-monotone array) has no work either.
    const int m_block = found.block >= 0 ? found.block : common::ceil_div(q.used, kBlockM);
    return {m_block, head, 0, q.start, k.start, q.used, k.used};
  }

  // Whether some tile writes query row t (of every head; t in [0, Tq)): t's sequence is the last whose clamped start
  // is <= t, t must lie in its used rows, and the virtual block holding t must resolve (tile() above) to that very
  // sequence and block. Then that block's tiles write t (store or store_empty: every used row of the tile); else no
  // tile does, with well-formed offsets and without.
  __host__ __device__ static bool row_written(const Params& params, int t) {
    int lo = 0, hi = params.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (common::clamp_offset(params.cu_seqlens_q[mid], params.total_q) <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const common::VarlenRows q = common::varlen_rows(params.cu_seqlens_q, params.seqused_q, lo, params.total_q);
    const int row = t - q.start;
    if (row < 0 || row >= q.used) return false;
    const int virtual_block = common::varlen_first_block<kBlockM>(params.cu_seqlens_q, lo, params.total_q) +
                              row / kBlockM;
    if (virtual_block >= params.num_blocks) return false;
    const common::VarlenBlock found =
        common::varlen_block<kBlockM>(params.cu_seqlens_q, params.num_seqs, params.total_q, virtual_block);
    return found.seq == lo && found.block == row / kBlockM;
  }
};

// out = 0 and lse = -inf (every head) in the query rows no tile of Scheduler writes (all rows when N = 0). One
// thread decides per row; a warp then writes each of its rows to fill together, in 16-byte stores (o's rows and
// heads are 16-byte aligned: the launcher checked TMA's alignment rules).
template <typename Element, int kHeadDim, typename Scheduler>
__global__ void fwd_varlen_fill_unwritten_kernel(const __grid_constant__ typename Scheduler::Params scheduler,
                                                 const __grid_constant__ FwdParams params) {
  constexpr int kVecElems = 16 / sizeof(Element);
  constexpr int kVecsPerHead = kHeadDim / kVecElems;
  static_assert(kHeadDim % kVecElems == 0);
  const int lane = threadIdx.x % 32;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t vecs_per_row = int64_t(params.heads_q) * kVecsPerHead;
  // base is warp-uniform: the warp's 32 rows, so that the ballot sees every lane.
  for (int64_t base = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32 * 32; base < params.seqlen_q;
       base += stride) {
    const int64_t t = base + lane;
    const bool unwritten =
        t < params.seqlen_q && (params.num_seqs <= 0 || !Scheduler::row_written(scheduler, static_cast<int>(t)));
    for (unsigned rows = __ballot_sync(0xffffffffu, unwritten); rows != 0; rows &= rows - 1) {
      const int64_t row = base + __ffs(rows) - 1;
      Element* o_row = static_cast<Element*>(params.o) + row * params.o_row_stride;
      for (int64_t i = lane; i < vecs_per_row; i += 32) {
        Element* o_vec = o_row + (i / kVecsPerHead) * params.o_head_stride + (i % kVecsPerHead) * kVecElems;
        *reinterpret_cast<uint4*>(o_vec) = make_uint4(0, 0, 0, 0);
      }
      if (params.lse != nullptr) {
        for (int h = lane; h < params.heads_q; h += 32) params.lse[h * params.lse_head_stride + row] = -INFINITY;
      }
    }
  }
}

}  // namespace flashjax::sm90

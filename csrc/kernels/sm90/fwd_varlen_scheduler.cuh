// Persistent tile scheduler of the sm90 forward for packed sequences (varlen, docs/design.md §2.7), and the fill of
// the query rows none of its tiles writes.
//
// Tiles are (virtual query block, query head) pairs, virtual blocks fastest: per head, varlen_num_blocks(Tq, N,
// kBlockM) of them (kernels/common/varlen.cuh: sequence b's blocks start at cu_seqlens_q[b] / kBlockM + b), so the
// walk covers the batch's real blocks plus at most one per sequence, never N x max_seqlen, and only the static
// shapes (Tq, N, Hq) size it: no compile and no host plan depends on the packing. How the CTAs share the positions
// is FLASHJAX_SM90_VARLEN_WALK's (VarlenWalk): round robin, contiguous ranges of equal modelled cost that each
// CTA's warps compute from the offsets at kernel start (cta_range, fwd_varlen_balance.cuh), or (the default) handed
// out at run time from a counter (fwd_varlen_ring.cuh). The dynamic walk visits each sequence's row blocks heaviest first
// (the last block of a causal sequence sees the most keys: tile()), so that first-come hand-out approximates
// longest-job-first while the CTAs running at once still share one sequence's K/V (L2). A tile resolves its
// sequence on the device by binary search (every warp that walks it: the producer's two and each consumer
// warpgroup), reading offsets that stay in L1 after the first tile.
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
#include "flashjax/settings.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/varlen.cuh"
#include "kernels/sm90/fwd_varlen_balance.cuh"

namespace flashjax::sm90 {

// How the CTAs share the walk's positions (FLASHJAX_SM90_VARLEN_WALK).
enum class VarlenWalk : int {
  kRoundRobin = 0,  // CTA c takes c, c + grid, ...
  kBalanced = 1,    // CTA c a contiguous range of equal modelled cost (fwd_varlen_balance.cuh)
  kDynamic = 2,     // CTA c takes c, then whatever the global counter hands out (fwd_varlen_ring.cuh)
};

// kPacked: tiles hold the query heads of a KV head (packed GQA, fwd_query_tiling.cuh): the walk's heads are the KV
// heads and a sequence's blocks are its packed tiles (VarlenBlockNumbering).
template <int kBlockM, int kBlockN, bool kPacked = false>
struct FwdVarlenTileSchedulerSm90 {
  using Balance = VarlenBalance<kBlockM, kBlockN, kPacked>;
  using Numbering = typename Balance::Numbering;
  using Range = typename Balance::Range;

  struct Params {
    int num_blocks;  // virtual query blocks per head (the walk's m-blocks)
    int heads;       // of the walk: Hq, or Hk where GQA is packed
    int group;       // query heads per tile: 1, or Hq / Hk where packed
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
    int window_left, window_right;  // the call's band (each sequence's, bottom-right aligned): the balance's model
    VarlenWalk walk;
    // kDynamic: the hand-out counter (the call's workspace), zeroed by the fill kernel that precedes every launch;
    // nullptr otherwise.
    int32_t* tile_counter;
  };

  // The tile's query head and virtual block, and its sequence's used rows in the packed tensors: query rows
  // [q_start, q_start + seqlen_q), keys [k_start, k_start + seqlen_k). m_block is the block within the sequence;
  // Past its sequence's tiles with rows (m_block >= row_blocks(seqlen_q)): no work (has_rows()). head: the query
  // head, or the KV head where packed (its group's query heads are the tile's rows, in FwdQueryTiling's order).
  struct Tile {
    int m_block;
    int head;
    int batch;  // always 0: the packed tensors are one batch
    int q_start, k_start;
    int seqlen_q, seqlen_k;
    int group;  // query heads per tile
    __host__ __device__ bool has_rows() const {
      if constexpr (kPacked) {
        return int64_t(m_block) * Numbering::kChunksPerTile <
               int64_t(group) * common::ceil_div(seqlen_q, Numbering::kChunkRows);
      } else {
        return m_block * kBlockM < seqlen_q;
      }
    }
  };

  // tiling: the FwdQueryTiling of the kernel (its group: 1 unpacked). tile_counter: the call's counter workspace
  // (FwdParams::varlen_tile_counter), nullptr where the call has none; the dynamic walk needs it.
  template <typename QueryTiling>
  static Params to_params(const AttnShape& shape, const QueryTiling& tiling, int num_sms,
                          int32_t* tile_counter = nullptr) {
    Params params{};
    const int group = kPacked ? tiling.group : 1;
    const int64_t num_blocks =
        shape.num_seqs > 0 ? Numbering::num_blocks(shape.seqlen_q, shape.num_seqs, group) : 0;
    const int64_t num_tiles = num_blocks * (shape.heads_q / group);
    params.num_blocks = static_cast<int>(num_blocks);
    params.heads = shape.heads_q / group;
    params.group = group;
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
    params.window_left = shape.window_left;
    params.window_right = shape.window_right;
    // The dynamic walk by default: it measured cost 1.30 / 0.85 against the dense call (64 sequences of 1..1024
    // tokens / 1000 of 0..512, H100) where round robin took 1.46 / 1.06 and the balanced ranges 1.57 / 0.98
    // (docs/performance.md 2.8). Only where the call brought a counter (a lowering for another setting, or an
    // exported artifact of the plain target, has none): round robin then.
    const int asked = setting_int(Setting::kSm90VarlenWalk, 2);
    params.walk = asked == 1                             ? VarlenWalk::kBalanced
                  : asked == 2 && tile_counter != nullptr ? VarlenWalk::kDynamic
                                                          : VarlenWalk::kRoundRobin;
    params.tile_counter = params.walk == VarlenWalk::kDynamic ? tile_counter : nullptr;
    return params;
  }

  static int grid_size(const Params& params) { return params.num_tiles > 0 ? params.grid : 0; }

  __host__ __device__ static VarlenBalanceInputs balance_inputs(const Params& params) {
    return {params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_q,  params.seqused_k,
            params.num_seqs,     params.total_q,      params.total_k,    params.num_blocks,
            params.heads,        params.group,        params.window_left, params.window_right};
  }

#if defined(__CUDA_ARCH__)
  // CTA cta's positions (warp-collective: every lane of a converged warp; each walking warp calls it once). The
  // ranges of the grid's CTAs cover [0, num_tiles) disjointly.
  __device__ static Range cta_range(const Params& params, int cta, int grid) {
    if (params.walk != VarlenWalk::kBalanced) return round_robin(params, cta, grid);
    return Balance::cta_range(balance_inputs(params), params.num_tiles, cta, grid);
  }
#endif
  // The same on the host (tests), with `lanes` simulated lanes.
  static Range cta_range_host(const Params& params, int cta, int grid, int lanes = 32) {
    if (params.walk != VarlenWalk::kBalanced) return round_robin(params, cta, grid);
    return Balance::cta_range_host(balance_inputs(params), params.num_tiles, cta, grid, lanes);
  }
  __host__ __device__ static Range round_robin(const Params& params, int cta, int grid) {
    return {cta < params.num_tiles ? cta : params.num_tiles, params.num_tiles, grid};
  }

  // The walk within a CTA's range: num_tiles once it is done.
  __host__ __device__ static int first_tile(const Params& params, const Range& range) {
    return range.begin < range.end ? range.begin : params.num_tiles;
  }
  __host__ __device__ static int next_tile(const Params& params, int range_end, int stride, int position) {
    return position + stride < range_end ? position + stride : params.num_tiles;
  }

  // Sequence b's first virtual block; virtual block v's sequence and block within it (common::varlen_block's
  // binary search, over this numbering).
  __host__ __device__ static int first_block(const Params& params, int b) {
    return Numbering::first_block(params.cu_seqlens_q, b, params.total_q, params.group);
  }
  __host__ __device__ static common::VarlenBlock find_block(const Params& params, int v) {
    if constexpr (!kPacked) {
      return common::varlen_block<kBlockM>(params.cu_seqlens_q, params.num_seqs, params.total_q, v);
    } else {
      int lo = 0, hi = params.num_seqs - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_block(params, mid) <= v) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      return {lo, v - first_block(params, lo)};
    }
  }

  // The block of its sequence that the walk's block `walk_block` (< row_blocks) of that sequence holds: itself, or
  // where the walk goes heaviest first (the dynamic walk), the blocks with rows in reverse. An involution, so it
  // also maps a tile's block back to its walk block (row_written).
  __host__ __device__ static int walk_order(const Params& params, int walk_block, int row_blocks) {
    return params.walk == VarlenWalk::kDynamic ? row_blocks - 1 - walk_block : walk_block;
  }

  // position in [0, num_tiles). The offsets must be readable where it runs (the device; the host in
  // tests/cpp/test_varlen_scheduler.cu).
  __host__ __device__ static Tile tile(const Params& params, int position) {
    int head, virtual_block;
    params.blocks_divmod(head, virtual_block, position);
    const common::VarlenBlock found = find_block(params, virtual_block);
    const common::VarlenRows q = common::varlen_rows(params.cu_seqlens_q, params.seqused_q, found.seq, params.total_q);
    const common::VarlenRows k = common::varlen_rows(params.cu_seqlens_k, params.seqused_k, found.seq, params.total_k);
    // A block before its sequence's start (a not-from-zero or non-monotone array) has no work either, nor one past
    // its rows (those keep their place after the sequence's row blocks in every order).
    const int row_blocks = Numbering::row_blocks(q.used, params.group);
    const int m_block = found.block < 0 ? row_blocks
                        : found.block < row_blocks ? walk_order(params, found.block, row_blocks)
                                                   : found.block;
    return {m_block, head, 0, q.start, k.start, q.used, k.used, params.group};
  }

  // Whether some tile writes query row t (of every head; t in [0, Tq)): t's sequence is the last whose clamped start
  // is <= t, t must lie in its used rows, and the virtual block of each tile holding t (one; where packed, those of
  // t's chunk in every query head of the group; the walk's order decides which virtual block a tile is) must resolve
  // (tile() above) to that very sequence and tile. Then those tiles write t (store or store_empty: every used row of
  // the tile); else no tile does, with well-formed offsets and without.
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
    int block_lo = row / kBlockM, block_hi = block_lo;
    if constexpr (kPacked) {
      const int64_t chunk = int64_t(row / Numbering::kChunkRows) * params.group;
      block_lo = int(chunk / Numbering::kChunksPerTile);
      block_hi = int((chunk + params.group - 1) / Numbering::kChunksPerTile);
    }
    const int first = first_block(params, lo);
    const int row_blocks = Numbering::row_blocks(q.used, params.group);  // > block_hi: row < used
    for (int block = block_lo; block <= block_hi; ++block) {
      const int walk_block = walk_order(params, block, row_blocks);
      const int64_t virtual_block = int64_t(first) + walk_block;
      if (virtual_block >= params.num_blocks) return false;
      const common::VarlenBlock found = find_block(params, int(virtual_block));
      if (found.seq != lo || found.block != walk_block) return false;
    }
    return true;
  }
};

// out = 0 and lse = -inf (every head) in the query rows no tile of Scheduler writes (all rows when N = 0), and the
// dynamic walk's counter = 0 (fwd_launch.cuh's launch_varlen_kernels says why here). One
// thread decides per row; a warp then writes each of its rows to fill together, in 16-byte stores (o's rows and
// heads are 16-byte aligned: the launcher checked TMA's alignment rules).
template <typename Element, int kHeadDim, typename Scheduler>
__global__ void fwd_varlen_fill_unwritten_kernel(const __grid_constant__ typename Scheduler::Params scheduler,
                                                 const __grid_constant__ FwdParams params) {
  constexpr int kVecElems = 16 / sizeof(Element);
  constexpr int kVecsPerHead = kHeadDim / kVecElems;
  static_assert(kHeadDim % kVecElems == 0);
  const int lane = threadIdx.x % 32;
  if (scheduler.tile_counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scheduler.tile_counter = 0;
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

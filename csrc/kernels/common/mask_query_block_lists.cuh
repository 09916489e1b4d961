// A mask mod's query-block lists (issue 38), for backward kernels whose producer, dQ writer and MMA warps walk one
// sequence of query blocks per key block (the sm90 backward): per (b, h, n-block), the m-blocks its CTA visits for
// query head h, built before the kernel from the band's range (bwd_band_mask.cuh's MBlockRange) and the tile classes
// of the backward's own tiles (mask_bits_tiles.cuh, kBlockM query rows x kBlockN keys):
//   [0] count, [1] how many of them are partial, [2 ..] the entries, in the band's order (ascending m-block), each
//   m_block * 2 + (1 if the bits leave the tile partial); empty tiles are left out.
// The band's own masking is not in the list: the kernel still asks BwdBandMask::needs_mask per step, as without a
// mask mod. The flag rides with the block so that every role reads one word per step; all roles read the same list,
// so they walk the same steps and the pipelines cannot fall out of step.
//
// The lists are the first part of the pass's mask workspace (flashjax/workspace.h, MaskBlockLists::kQueryBlocks):
// int32 [Bm, Hm, n_blocks, m_blocks + kBlockListHeader]. Host-callable rule (build_query_block_list) for tests/cpp.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "flashjax/params.h"
#include "kernels/common/bwd_band_mask.cuh"
#include "kernels/common/mask_bits_tiles.cuh"
#include "kernels/common/mask_block_lists.cuh"

namespace flashjax::common {

// The query blocks of one (b, h, n-block), in the interface of the dense backward's m-block range: the steps are
// t in [first(), last()), m_block(t) the block of step t (the dense range has first() = m_begin and m_block(t) = t).
struct ListedMBlocks {
  const int32_t* list = nullptr;
  int count = 0;
  __host__ __device__ int first() const { return 0; }
  __host__ __device__ int last() const { return count; }
  __host__ __device__ int m_block(int t) const { return m_block_of(entry(t)); }
  __host__ __device__ bool partial(int t) const { return partial_of(entry(t)); }
  // Step t's entry, read once where a loop needs both its block and its flag (the reads are global loads).
  __host__ __device__ int entry(int t) const { return list[kBlockListHeader + t]; }
  // The entry encoding, both ways: m_block * 2 + partial.
  __host__ __device__ static int entry_of(int m_block, bool partial) { return m_block * 2 + (partial ? 1 : 0); }
  __host__ __device__ static int m_block_of(int entry) { return entry >> 1; }
  __host__ __device__ static bool partial_of(int entry) { return (entry & 1) != 0; }
};

// Where the lists of a call live, from its AttnShape; kBlockM x kBlockN are the backward's tiles.
template <int kBlockM, int kBlockN>
struct MaskQueryBlockLists {
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  static __host__ __device__ int list_length(const AttnShape& s) { return Classes::m_blocks(s) + kBlockListHeader; }

  // The list of (batch, head_q, n_block); b and h collapse to 0 where the bits broadcast, as the classes do.
  static __host__ __device__ const int32_t* list(const AttnShape& s, int batch, int head_q, int n_block) {
    const int b = s.mask_batch_stride != 0 ? batch : 0;
    const int h = s.mask_head_stride != 0 ? head_q : 0;
    return s.mask_block_lists +
           ((int64_t(b) * Classes::mask_heads(s) + h) * Classes::n_blocks(s) + n_block) * list_length(s);
  }
  // Ints from one query head's list to the next head's (0 where the bits broadcast over heads).
  static __host__ __device__ int64_t head_stride(const AttnShape& s) {
    return s.mask_head_stride != 0 ? int64_t(Classes::n_blocks(s)) * list_length(s) : 0;
  }
};

// The list of one (b, h, n-block) from the band's m-block range and the classes of that n-block's column
// (classes[m * class_stride] is the class of m-block m). Writes the header and the entries into `list`; the appender
// as build_block_list's (mask_block_lists.cuh).
template <class Append = SerialAppend>
__host__ __device__ inline void build_query_block_list(const MBlockRange& band, const uint8_t* classes,
                                                       int64_t class_stride, int32_t* list, Append append = {}) {
  const auto tile_class = [&](int m) { return classes[m * class_stride]; };
  list[0] = append(list + kBlockListHeader, band.begin, band.end, [&](int m) { return tile_is_visited(tile_class(m)); },
                   [&](int m) { return ListedMBlocks::entry_of(m, tile_class(m) == kMaskTilePartial); }, 0);
  list[1] = append.count_kept(band.begin, band.end, [&](int m) { return tile_class(m) == kMaskTilePartial; });
}

template <int kBlockM, int kBlockN>
__global__ void mask_query_block_lists_kernel(const AttnShape s) {
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  using Lists = MaskQueryBlockLists<kBlockM, kBlockN>;
  const int m_blocks = Classes::m_blocks(s), n_blocks = Classes::n_blocks(s);
  const int64_t lists = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * n_blocks;
  const int64_t index = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // one warp per list
  if (index >= lists) return;  // the whole warp leaves together: WarpAppend's ballots see full warps only
  const int n_block = static_cast<int>(index % n_blocks);
  const int64_t batch_head = index / n_blocks;
  const BwdBandMask band(s.seqlen_q, s.seqlen_k, s.window_left, s.window_right);
  // The column of n_block in the [.., m_blocks, n_blocks] classes of this (b, h).
  const uint8_t* column = s.mask_tile_classes + batch_head * m_blocks * n_blocks + n_block;
  build_query_block_list(band.m_blocks<kBlockM, kBlockN>(n_block * kBlockN), column, n_blocks,
                         s.mask_block_lists + index * Lists::list_length(s), WarpAppend{});
}

// Classifies the call's tiles (launch_mask_bits_tiles), then lists each key block's query blocks; both on `stream`,
// before the kernel that walks them. Every list is written, also with Sq = 0 (the band's range is empty, so is the
// list), since the kernel reads one for each of its CTAs and query heads.
template <int kBlockM, int kBlockN>
cudaError_t launch_mask_query_block_lists(const AttnShape& s, cudaStream_t stream) {
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  if (s.mask_bits == nullptr || s.mask_block_lists == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = launch_mask_bits_tiles<kBlockM, kBlockN>(s, stream);
  if (err != cudaSuccess) return err;
  if (s.seqlen_k <= 0 || s.batch <= 0 || s.heads_q <= 0) return cudaSuccess;  // no CTA reads a list
  constexpr int kListsPerBlock = 4;  // warps
  const int64_t lists = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * Classes::n_blocks(s);
  const int64_t blocks = (lists + kListsPerBlock - 1) / kListsPerBlock;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  mask_query_block_lists_kernel<kBlockM, kBlockN><<<static_cast<unsigned>(blocks), kListsPerBlock * 32, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace flashjax::common

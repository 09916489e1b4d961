// A mask mod's block lists (issue 38), for kernels whose producer and consumers walk one sequence of KV blocks per
// tile (the sm90 forward): per (b, h, m-block), the n-blocks the tile visits, in the order it visits them, built from
// the band's range (band_mask.cuh's KvBlockRange) and the tile classes (mask_bits_tiles.cuh) before the kernel:
//   [0] count, [1] how many of them need the per-element mask, [2 ..] the blocks: first every block the band masks or
//   the bits leave partial (in the band's visiting order), then the full ones (likewise); empty tiles are left out.
// With the list in that shape, a kernel written for KvBlockRange (masked blocks first, then a mask-free bulk) walks
// it unchanged: ListedKvBlocks answers the same three questions from the list, so the same loops skip the empty
// tiles and run the full ones without mask code. Both sides read the same list, so they agree on every stage.
//
// One warp per list (a row of m-block classes), 32 positions a round (WarpAppend): a thread per list walked its row
// one dependent load at a time, and at B 1 all the lists fit one CTA (S 16k: 29 us for the forward's lists, 101 us
// for the backward's column walks, H100). The rule is written once (build_block_list, over an appender), so that
// tests/cpp run it on host arrays with SerialAppend.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/mask_bits.cuh"
#include "kernels/common/mask_bits_tiles.cuh"

namespace flashjax::common {

inline constexpr int kBlockListHeader = 2;  // count, masked count

// The blocks of one tile as a list: the KvBlockRange interface (num_blocks, num_masked, block_at, empty) over
// list[kBlockListHeader ..]. block_at reads global memory: the producer reads ahead of the consumers, so the words
// are in L1 / L2 by the time the consumers ask.
struct ListedKvBlocks {
  const int32_t* list = nullptr;
  int count = 0;
  int masked = 0;
  __host__ __device__ bool empty() const { return count <= 0; }
  __host__ __device__ int num_blocks() const { return count; }
  __host__ __device__ int num_masked() const { return masked; }
  __host__ __device__ int block_at(int t) const { return list[kBlockListHeader + t]; }
};

// What a kernel walking block lists reads of the call, compact enough for its kernel parameters (whose 4 KB the
// sm90 forward's tail plan mostly fills): the lists' and the bits' pointers and strides, from the call's AttnShape.
struct MaskModTiles {
  const int32_t* lists;
  const uint32_t* bits;
  int64_t bits_batch_stride, bits_head_stride;  // words; 0 where the bits broadcast
  int32_t words;                                // per bits row
  int32_t seqlen_q;
  int32_t list_heads;   // Hm: heads of the lists and bits (Hq, or 1 where the bits broadcast over heads)
  int32_t m_blocks;     // lists per (b, h)
  int32_t list_length;  // n_blocks + kBlockListHeader

  template <int kBlockM, int kBlockN>
  static MaskModTiles of(const AttnShape& s) {
    using Classes = MaskTileClasses<kBlockM, kBlockN>;
    return {s.mask_block_lists, s.mask_bits, s.mask_batch_stride, s.mask_head_stride, s.mask_words, s.seqlen_q,
            Classes::mask_heads(s), Classes::m_blocks(s), Classes::n_blocks(s) + kBlockListHeader};
  }

  __device__ __forceinline__ ListedKvBlocks blocks(int batch, int head_q, int m_block) const {
    const int b = bits_batch_stride != 0 ? batch : 0;
    const int h = bits_head_stride != 0 ? head_q : 0;
    ListedKvBlocks listed;
    listed.list = lists + ((int64_t(b) * list_heads + h) * m_blocks + m_block) * list_length;
    listed.count = listed.list[0];
    listed.masked = listed.list[1];
    return listed;
  }

  __device__ __forceinline__ MaskBitsRows bits_rows(int batch, int head_q) const {
    return {bits + batch * bits_batch_stride + head_q * bits_head_stride, words, seqlen_q};
  }
};

// Appenders: append(out, begin, end, keep, value, count) writes value(t) for each t in [begin, end) that keep(t)
// keeps, in order, to out[count ..] and returns the new count; count_kept(begin, end, keep) counts them.
// SerialAppend is a plain loop (host and device); WarpAppend takes 32 positions a round, each kept lane writing at
// its rank among the round's votes, and must be called by all 32 lanes of a warp with the same arguments (every lane
// returns the same count).
struct SerialAppend {
  template <class Keep, class Value>
  __host__ __device__ int operator()(int32_t* out, int begin, int end, Keep keep, Value value, int count) const {
    for (int t = begin; t < end; ++t) {
      if (keep(t)) out[count++] = value(t);
    }
    return count;
  }
  template <class Keep>
  __host__ __device__ int count_kept(int begin, int end, Keep keep) const {
    int count = 0;
    for (int t = begin; t < end; ++t) count += keep(t) ? 1 : 0;
    return count;
  }
};

struct WarpAppend {
  template <class Keep, class Value>
  __device__ int operator()(int32_t* out, int begin, int end, Keep keep, Value value, int count) const {
    const unsigned lane = threadIdx.x % 32;
    for (int round = begin; round < end; round += 32) {
      const int t = round + static_cast<int>(lane);
      const bool kept = t < end && keep(t);
      const unsigned votes = __ballot_sync(0xffffffffu, kept);
      if (kept) out[count + __popc(votes & ((1u << lane) - 1u))] = value(t);
      count += __popc(votes);
    }
    return count;
  }
  template <class Keep>
  __device__ int count_kept(int begin, int end, Keep keep) const {
    int count = 0;
    for (int round = begin; round < end; round += 32) {
      const int t = round + static_cast<int>(threadIdx.x % 32);
      count += __popc(__ballot_sync(0xffffffffu, t < end && keep(t)));
    }
    return count;
  }
};

// The list of one tile from the band's range and the tile's row of classes (indexed by n-block). Writes count,
// masked and the blocks into `list` (n_blocks + 2 entries). With WarpAppend every lane writes the same header.
template <class Append = SerialAppend>
__host__ __device__ inline void build_block_list(const KvBlockRange& band, const uint8_t* classes, int32_t* list,
                                                 Append append = {}) {
  const auto block = [&](int t) { return band.block_at(t); };
  // The masked section: blocks the band masks or the bits leave partial, not empty, in the band's order.
  const int masked = append(list + kBlockListHeader, 0, band.num_blocks(), [&](int t) {
    const uint8_t c = classes[band.block_at(t)];
    return tile_is_visited(c) && (t < band.num_masked() || c == kMaskTilePartial);
  }, block, 0);
  // The bulk: blocks unmasked by the band and full by the bits.
  const int count = append(list + kBlockListHeader, band.num_masked(), band.num_blocks(),
                           [&](int t) { return classes[band.block_at(t)] == kMaskTileFull; }, block, masked);
  list[0] = count;
  list[1] = masked;
}

template <int kBlockM, int kBlockN>
__global__ void mask_block_lists_kernel(const AttnShape s) {
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  const int m_blocks = Classes::m_blocks(s), n_blocks = Classes::n_blocks(s);
  const int64_t lists = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * m_blocks;
  const int64_t index = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // one warp per list
  if (index >= lists) return;  // the whole warp leaves together: WarpAppend's ballots see full warps only
  const int m_block = static_cast<int>(index % m_blocks);
  const BandMask band(s.seqlen_q, s.seqlen_k, s.window_left, s.window_right);
  build_block_list(band.kv_blocks<kBlockM, kBlockN>(m_block * kBlockM), s.mask_tile_classes + index * n_blocks,
                   s.mask_block_lists + index * (int64_t(n_blocks) + kBlockListHeader), WarpAppend{});
}

// Classifies the call's tiles (launch_mask_bits_tiles), then lists each tile's blocks; both on `stream`, before the
// kernel that walks them.
template <int kBlockM, int kBlockN>
cudaError_t launch_mask_block_lists(const AttnShape& s, cudaStream_t stream) {
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  if (s.mask_bits == nullptr || s.mask_block_lists == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = launch_mask_bits_tiles<kBlockM, kBlockN>(s, stream);
  if (err != cudaSuccess) return err;
  // Every list is written, also with Sk = 0 (no class to read: the band's range is empty, so is the list), since the
  // kernel reads a list for each of its tiles.
  if (s.seqlen_q <= 0 || s.batch <= 0 || s.heads_q <= 0) return cudaSuccess;  // no tile
  constexpr int kListsPerBlock = 4;  // warps
  const int64_t lists = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * Classes::m_blocks(s);
  const int64_t blocks = (lists + kListsPerBlock - 1) / kListsPerBlock;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  mask_block_lists_kernel<kBlockM, kBlockN><<<static_cast<unsigned>(blocks), kListsPerBlock * 32, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace flashjax::common

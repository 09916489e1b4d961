// A mask mod's block lists (issue 38), for kernels whose producer and consumers walk one sequence of KV blocks per
// tile (the sm90 forward): per (b, h, m-block), the n-blocks the tile visits, in the order it visits them, built from
// the band's range (band_mask.cuh's KvBlockRange) and the tile classes (mask_bits_tiles.cuh) before the kernel:
//   [0] count, [1] how many of them need the per-element mask, [2 ..] the blocks: first every block the band masks or
//   the bits leave partial (in the band's visiting order), then the full ones (likewise); empty tiles are left out.
// With the list in that shape, a kernel written for KvBlockRange (masked blocks first, then a mask-free bulk) walks
// it unchanged: ListedKvBlocks answers the same three questions from the list, so the same loops skip the empty
// tiles and run the full ones without mask code. Both sides read the same list, so they agree on every stage.
//
// One thread per list (a row of m-block classes): its work is a pass over at most n_blocks bytes, negligible next to
// the classification's pass over the bits. Host-callable helpers are __host__ __device__ so that tests/cpp can run
// the list rule on host arrays (build_block_list).
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

// The list of one tile from the band's range and the tile's row of classes (indexed by n-block). Writes count,
// masked and the blocks into `list` (n_blocks + 2 entries).
__host__ __device__ inline void build_block_list(const KvBlockRange& band, const uint8_t* classes, int32_t* list) {
  int count = 0;
  for (int t = 0; t < band.num_blocks(); ++t) {  // the masked section: band-masked or partial, not empty
    const int block = band.block_at(t);
    const uint8_t c = classes[block];
    if (c != kMaskTileEmpty && (t < band.num_masked() || c == kMaskTilePartial)) list[kBlockListHeader + count++] = block;
  }
  const int masked = count;
  for (int t = band.num_masked(); t < band.num_blocks(); ++t) {  // the bulk: unmasked by the band and full
    const int block = band.block_at(t);
    if (classes[block] == kMaskTileFull) list[kBlockListHeader + count++] = block;
  }
  list[0] = count;
  list[1] = masked;
}

template <int kBlockM, int kBlockN>
__global__ void mask_block_lists_kernel(const AttnShape s) {
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  const int m_blocks = Classes::m_blocks(s), n_blocks = Classes::n_blocks(s);
  const int64_t lists = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * m_blocks;
  const int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= lists) return;
  const int m_block = static_cast<int>(index % m_blocks);
  const BandMask band(s.seqlen_q, s.seqlen_k, s.window_left, s.window_right);
  build_block_list(band.kv_blocks<kBlockM, kBlockN>(m_block * kBlockM), s.mask_tile_classes + index * n_blocks,
                   s.mask_block_lists + index * (int64_t(n_blocks) + kBlockListHeader));
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
  constexpr int kThreads = 128;
  const int64_t lists = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * Classes::m_blocks(s);
  const int64_t blocks = (lists + kThreads - 1) / kThreads;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  mask_block_lists_kernel<kBlockM, kBlockN><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace flashjax::common

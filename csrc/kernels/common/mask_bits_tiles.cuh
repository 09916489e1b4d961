// A mask mod's tile classes (issue 38): before an attention kernel, this small kernel reduces the mask bits
// (AttnShape::mask_bits, layout in flashjax/params.h) into one class per (b, h, m-block, n-block) of that kernel's
// own tiles: empty (no bit set among the tile's valid rows and columns), full (all of them set) or partial. The
// attention kernels skip empty tiles, run full ones without per-element mask code and apply the bits on partial
// ones only (kernels/common/mask_bits.cuh), composed with the band (band_mask.cuh): a tile is empty if either says
// so and needs no mask only if both say full. python/flashjax/mask_tiles.py is the same rule in numpy, tested on
// the CPU (tests/cpu/test_mask_tiles.py).
//
// Each pass classifies for its own tiles (the forward's kBlockM x kBlockN; the backward's query step x keys per
// CTA), into the workspace XLA allocated by mask_tile_classes_layout (flashjax/workspace.h), on the launcher's
// stream just before the kernel that reads them.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "flashjax/mask_grid.h"
#include "flashjax/params.h"
#include "flashjax/workspace.h"

namespace flashjax::common {

enum MaskTileClass : uint8_t { kMaskTileEmpty = 0, kMaskTilePartial = 1, kMaskTileFull = 2 };

// Whether a pass visits a tile of this class: the one rule by which a key block's query-block list keeps a query
// block (mask_query_block_lists.cuh) and the deterministic dQ writer counts the key blocks ahead of it
// (NonEmptyTiles below), so that the two cannot disagree on a step.
__host__ __device__ constexpr bool tile_is_visited(uint8_t tile_class) { return tile_class != kMaskTileEmpty; }

// Where the classes of one (batch, query head) start, and how many n-blocks a row of m-block classes holds. The
// classes are [Bm, Hm, m_blocks, n_blocks]: b and h collapse to 0 where the bits broadcast (stride 0), as the bits do.
template <int kBlockM, int kBlockN>
struct MaskTileClasses {
  static __host__ __device__ int m_blocks(const AttnShape& s) { return (s.seqlen_q + kBlockM - 1) / kBlockM; }
  static __host__ __device__ int n_blocks(const AttnShape& s) { return (s.seqlen_k + kBlockN - 1) / kBlockN; }
  static __host__ __device__ int mask_batches(const AttnShape& s) { return s.mask_batch_stride != 0 ? s.batch : 1; }
  static __host__ __device__ int mask_heads(const AttnShape& s) { return s.mask_head_stride != 0 ? s.heads_q : 1; }

  // The classes of m-block m_block of (batch, head_q), one per n-block.
  static __device__ __forceinline__ const uint8_t* row(const AttnShape& s, int batch, int head_q, int m_block) {
    const int b = s.mask_batch_stride != 0 ? batch : 0;
    const int h = s.mask_head_stride != 0 ? head_q : 0;
    return s.mask_tile_classes + ((int64_t(b) * mask_heads(s) + h) * m_blocks(s) + m_block) * n_blocks(s);
  }

  // Class of tile (m_block, n_block) of (batch, head_q).
  static __device__ __forceinline__ MaskTileClass at(const AttnShape& s, int batch, int head_q, int m_block,
                                                     int n_block) {
    return static_cast<MaskTileClass>(row(s, batch, head_q, m_block)[n_block]);
  }
};

// One m-block's row of classes as a predicate over its n-blocks (tile_is_visited): the sm90 backward's
// deterministic dQ writer counts the key blocks ahead of it with it (sm90/bwd_dq_order.cuh).
struct NonEmptyTiles {
  const uint8_t* row;  // MaskTileClasses::row of the (batch, head, m-block)
  __device__ bool operator()(int n_block) const { return tile_is_visited(row[n_block]); }
};

inline constexpr int kMaskTilesWarps = 4;

// One warp per tile: its lanes read the tile's words (a kBlockN-key row is kBlockN / 32 whole words, since n-blocks
// start on word boundaries), each word cut to the tile's valid columns (keys < Sk), and vote.
template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kMaskTilesWarps * 32) mask_bits_tiles_kernel(const AttnShape s) {
  static_assert(kBlockN % 32 == 0, "n-blocks must start on 32-key word boundaries");
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  constexpr int kWordsPerRow = kBlockN / 32;
  const int lane = threadIdx.x % 32;
  const int m_blocks = Classes::m_blocks(s), n_blocks = Classes::n_blocks(s);
  const int64_t tiles = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * m_blocks * n_blocks;
  const int64_t tile = int64_t(blockIdx.x) * kMaskTilesWarps + threadIdx.x / 32;
  if (tile >= tiles) return;  // the whole warp leaves together: the votes below see full warps only
  const int n_block = static_cast<int>(tile % n_blocks);
  const int m_block = static_cast<int>(tile / n_blocks % m_blocks);
  const int64_t batch_head = tile / (int64_t(n_blocks) * m_blocks);
  const int h = static_cast<int>(batch_head % Classes::mask_heads(s));
  const int b = static_cast<int>(batch_head / Classes::mask_heads(s));

  const int m_start = m_block * kBlockM;
  const int rows = min(kBlockM, s.seqlen_q - m_start);
  const int col_end = min(n_block * kBlockN + kBlockN, s.seqlen_k);
  const uint32_t* words = s.mask_bits + b * s.mask_batch_stride + h * s.mask_head_stride +
                          int64_t(m_start) * s.mask_words;
  bool any = false, all = true;
  for (int i = lane; i < rows * kWordsPerRow; i += 32) {
    const int row = i / kWordsPerRow;
    const int word = n_block * kWordsPerRow + i % kWordsPerRow;
    const int valid = col_end - word * 32;  // keys of this word inside [n_start, min(n_end, Sk))
    if (valid <= 0 || word >= s.mask_words) continue;
    const uint32_t keep = valid >= 32 ? 0xffffffffu : (1u << valid) - 1u;
    const uint32_t bits = words[int64_t(row) * s.mask_words + word] & keep;
    any |= bits != 0u;
    all &= bits == keep;
  }
  any = __any_sync(0xffffffffu, any);
  all = __all_sync(0xffffffffu, all);
  if (lane == 0) s.mask_tile_classes[tile] = !any ? kMaskTileEmpty : all ? kMaskTileFull : kMaskTilePartial;
}

// Classifies the tiles of a call with mask bits (a no-op without): the launchers call it on their stream first, with
// the bits' grid as a dense shape (mask_bits_grid in flashjax/mask_grid.h: a packed call's is its N padded sequences).
template <int kBlockM, int kBlockN>
cudaError_t launch_mask_bits_tiles(const AttnShape& s, cudaStream_t stream) {
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  if (s.mask_bits == nullptr) return cudaSuccess;
  // A shape with offsets is not a grid: varlen launchers pass mask_bits_grid(params).
  if (s.mask_tile_classes == nullptr || s.cu_seqlens_q != nullptr) return cudaErrorInvalidValue;
  if (s.seqlen_q <= 0 || s.seqlen_k <= 0 || s.batch <= 0 || s.heads_q <= 0) return cudaSuccess;  // no tile
  const int64_t tiles = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * Classes::m_blocks(s) *
                        Classes::n_blocks(s);
  const int64_t blocks = (tiles + kMaskTilesWarps - 1) / kMaskTilesWarps;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  mask_bits_tiles_kernel<kBlockM, kBlockN>
      <<<static_cast<unsigned>(blocks), kMaskTilesWarps * 32, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace flashjax::common

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

// How many words of a row one warp of mask_bits_tiles_kernel covers: 32, or where a row of tiles has fewer words,
// the least power of two that holds them (at least one tile's); its other lanes then take other rows.
template <int kBlockN>
__host__ __device__ inline int mask_tiles_span(int n_blocks) {
  int span = kBlockN / 32;
  while (span < 32 && span < n_blocks * (kBlockN / 32)) span *= 2;
  return span;
}

// One warp per (b, h, m-block, `span` consecutive words of the bits' rows): lane l reads word l % span of rows
// l / span, l / span + 32 / span, ... of the m-block, so a row is one coalesced load of up to 128 bytes (one or two
// cache lines) and the loads are independent (several in flight), and keeps whether any / all of the word's valid
// keys (< Sk) are set; the lanes of one word, then the kBlockN / 32 words of each tile, combine their votes by
// shuffles (n-blocks start on word boundaries). A warp per tile, reading 16 bytes of each row, ran at about 1.3 TB/s
// (window S 16k: 26 us for 33.5 MB, H100).
template <int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kMaskTilesWarps * 32) mask_bits_tiles_kernel(const AttnShape s) {
  static_assert(kBlockN % 32 == 0 && 32 % (kBlockN / 32) == 0,
                "n-blocks must be whole 32-key words, a power-of-two count of them up to 32");
  using Classes = MaskTileClasses<kBlockM, kBlockN>;
  constexpr int kWordsPerTile = kBlockN / 32;
  const int lane = threadIdx.x % 32;
  const int m_blocks = Classes::m_blocks(s), n_blocks = Classes::n_blocks(s);
  const int span = mask_tiles_span<kBlockN>(n_blocks);
  const int tiles_per_warp = span / kWordsPerTile;
  const int groups = (n_blocks + tiles_per_warp - 1) / tiles_per_warp;  // warps per row of tiles
  const int64_t tasks = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * m_blocks * groups;
  const int64_t task = int64_t(blockIdx.x) * kMaskTilesWarps + threadIdx.x / 32;
  if (task >= tasks) return;  // the whole warp leaves together: the shuffles below see full warps only
  const int group = static_cast<int>(task % groups);
  const int m_block = static_cast<int>(task / groups % m_blocks);
  const int64_t batch_head = task / (int64_t(groups) * m_blocks);
  const int h = static_cast<int>(batch_head % Classes::mask_heads(s));
  const int b = static_cast<int>(batch_head / Classes::mask_heads(s));

  const int m_start = m_block * kBlockM;
  const int rows = min(kBlockM, s.seqlen_q - m_start);
  const int word = group * span + lane % span;
  const int valid = s.seqlen_k - word * 32;  // keys of this word below Sk
  bool any = false, all = true;              // a word past the keys votes neither way
  if (valid > 0 && word < s.mask_words) {
    const uint32_t keep = valid >= 32 ? 0xffffffffu : (1u << valid) - 1u;
    const uint32_t* column = s.mask_bits + b * s.mask_batch_stride + h * s.mask_head_stride +
                             int64_t(m_start) * s.mask_words + word;
    const int row_step = 32 / span;
#pragma unroll 8
    for (int row = lane / span; row < rows; row += row_step) {
      const uint32_t bits = column[int64_t(row) * s.mask_words] & keep;
      any |= bits != 0u;
      all &= bits == keep;
    }
  }
  // The lanes of one word (lane % span equal: xor by multiples of span), then the words of one tile (aligned groups
  // of kWordsPerTile lanes).
  for (int offset = 32 / 2; offset >= 1; offset /= 2) {
    if (offset < span && offset >= kWordsPerTile) continue;  // a different tile's word: not combined
    any = __shfl_xor_sync(0xffffffffu, int(any), offset) != 0 || any;
    all = __shfl_xor_sync(0xffffffffu, int(all), offset) != 0 && all;
  }
  const int n_block = group * tiles_per_warp + lane % span / kWordsPerTile;
  if (lane < span && lane % kWordsPerTile == 0 && n_block < n_blocks) {
    s.mask_tile_classes[(batch_head * m_blocks + m_block) * n_blocks + n_block] =
        !any ? kMaskTileEmpty : all ? kMaskTileFull : kMaskTilePartial;
  }
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
  const int tiles_per_warp = mask_tiles_span<kBlockN>(Classes::n_blocks(s)) / (kBlockN / 32);
  const int64_t warps = int64_t(Classes::mask_batches(s)) * Classes::mask_heads(s) * Classes::m_blocks(s) *
                        ((Classes::n_blocks(s) + tiles_per_warp - 1) / tiles_per_warp);
  const int64_t blocks = (warps + kMaskTilesWarps - 1) / kMaskTilesWarps;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  mask_bits_tiles_kernel<kBlockM, kBlockN>
      <<<static_cast<unsigned>(blocks), kMaskTilesWarps * 32, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace flashjax::common

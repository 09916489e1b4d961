// Which query rows a tile of the sm90 forward holds: (position, query head) of each of its kBlockM rows.
//
// Unpacked (kPacked false, group 1): tile m of walk head h holds positions [m * kBlockM, (m + 1) * kBlockM) of
// query head h. Packed GQA (kPacked, group = G = Hq / Hk): walk head h is a KV head, and its G query heads share the
// tiles. Their rows come in chunks of kPackedChunkRows consecutive positions of one head, numbered head fastest:
// chunk c holds positions [8 * (c / G), 8 * (c / G) + 8) of query head h * G + c % G, and tile m holds chunks
// [m * kBlockM / 8, ...). A tile thus spans about kBlockM / G positions of every head of the group, so short
// sequences fill it (decode: one position of G heads), and its K/V blocks are loaded once for all G heads. Chunks
// past the last position are zero-filled by TMA on load and clipped on store, like rows past Sq unpacked.
//
// The chunk is one swizzle atom (8 rows) of the shared Q / O tile, so a packed tile has the same shared-memory
// image as an unpacked one and the GEMMs do not change: only the TMA boxes (one per chunk), the per-row masks, sinks
// and LSE, and the scheduler's KV range per tile (from its positions) do. Packing is a compile-time choice
// (FwdKernelSm90's kPackGqa) that leaves the unpacked kernels' code as it was: as a runtime one, its registers and
// per-tile instructions cost them 1-7% on the H200 (docs/performance.md).
#pragma once

#include <cutlass/fast_math.h>

#include "kernels/common/fast_math.cuh"
#include "kernels/sm90/fwd_pack_gqa.h"

namespace flashjax::sm90 {

template <int kBlockM, bool kPacked>
struct FwdQueryTiling {
  static constexpr int kChunkRows = kPackedChunkRows;
  static constexpr int kChunksPerTile = kBlockM / kChunkRows;
  static_assert(kBlockM % kChunkRows == 0);

  int group;  // query heads per tile: 1 unpacked
  int seqlen_q;
  cutlass::FastDivmod group_divmod;

  FwdQueryTiling() = default;
  __host__ FwdQueryTiling(int group_, int seqlen_q_)
      : group(kPacked ? group_ : 1), seqlen_q(seqlen_q_), group_divmod(kPacked ? group_ : 1) {}

  __host__ __device__ static constexpr bool packed() { return kPacked; }

  // Tiles per walk head (the scheduler's m-blocks).
  __host__ __device__ int num_m_blocks() const {
    if (!packed()) return common::ceil_div(seqlen_q, kBlockM);
    return common::ceil_div(group * common::ceil_div(seqlen_q, kChunkRows), kChunksPerTile);
  }

  struct Row {
    int position;  // may be >= Sq: a row of zero-filled Q, never stored
    int head_q;
  };
  // Row r of tile m_block of walk head `head` (0 <= r < kBlockM).
  __host__ __device__ Row row(int m_block, int head, int r) const {
    if (!packed()) return {m_block * kBlockM + r, head};
    const Row chunk_start = chunk(m_block * kChunksPerTile + r / kChunkRows, head);
    return {chunk_start.position + r % kChunkRows, chunk_start.head_q};
  }
  // First row of chunk c (packed only).
  __host__ __device__ Row chunk(int c, int head) const {
    int position_chunk, head_in_group;
    group_divmod(position_chunk, head_in_group, c);
    return {position_chunk * kChunkRows, head * group + head_in_group};
  }

  // The positions the tile's rows inside [0, Sq) span: [first, last], first <= last for every m_block below
  // num_m_blocks() (its first chunk or row lies before Sq).
  struct Positions {
    int first, last;
  };
  __host__ __device__ Positions positions(int m_block) const {
    if (!packed()) return {m_block * kBlockM, min(m_block * kBlockM + kBlockM, seqlen_q) - 1};
    const int num_chunks = group * common::ceil_div(seqlen_q, kChunkRows);
    const int first_chunk = m_block * kChunksPerTile;
    const int last_chunk = min(first_chunk + kChunksPerTile, num_chunks) - 1;
    return {chunk(first_chunk, 0).position, min(chunk(last_chunk, 0).position + kChunkRows, seqlen_q) - 1};
  }
};

}  // namespace flashjax::sm90

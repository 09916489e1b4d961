// The causal / sliding-window band of docs/design.md §2.3 (bottom-right aligned), as a policy with two halves:
//   1. which KV blocks a tile of query rows must visit, and which of those need no per-element mask (KvBlockRange);
//   2. the per-element predicate, applied to score fragments in (row, col) view (TileMask).
// Key j is visible to query i iff  j < Sk,  j <= i + (Sk - Sq) + right (right >= 0),  j >= i + (Sk - Sq) - left (left >= 0).
// Sequence lengths are assumed below 2^30 (the int32 arithmetic and the unbounded sentinels rely on it).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/fast_math.cuh"

namespace flashjax::common {

// KV blocks [n_block_min, n_block_max) hold every key a query tile can see; blocks outside are never loaded (this
// is what makes sliding windows cost O(window), not O(Sk)). Blocks in [n_unmasked_begin, n_unmasked_end) are fully
// visible to every row of the tile and need no per-element mask.
//
// Visiting order (block_at): the masked blocks first (right edge, then left edge, each walking down), then the
// unmasked ones. Online softmax is order-independent, and this order lets a kernel run the masked blocks in one loop
// and the bulk in a second, mask-free loop whose registers are not taken by mask state.
struct KvBlockRange {
  int n_block_min;
  int n_block_max;
  int n_unmasked_begin;  // n_block_min <= n_unmasked_begin <= n_unmasked_end <= n_block_max
  int n_unmasked_end;

  __host__ __device__ bool empty() const { return n_block_max <= n_block_min; }
  __host__ __device__ int num_blocks() const { return n_block_max - n_block_min; }
  __host__ __device__ int num_masked() const { return num_blocks() - (n_unmasked_end - n_unmasked_begin); }
  // The t-th block to visit, 0 <= t < num_blocks().
  __host__ __device__ int block_at(int t) const {
    const int num_right_masked = n_block_max - n_unmasked_end;
    if (t < num_right_masked) return n_block_max - 1 - t;
    const int num_masked_total = num_masked();
    if (t < num_masked_total) return n_unmasked_begin - 1 - (t - num_right_masked);
    return n_unmasked_end - 1 - (t - num_masked_total);
  }
  // Part `index` of `parts` near-equal runs of consecutive blocks (split keys: each part is a tile's KV range of its
  // own, masked blocks still classified by the full band). Parts may be empty where parts > num_blocks().
  __host__ __device__ KvBlockRange part(int index, int parts) const {
    const int n = num_blocks();
    KvBlockRange range;
    range.n_block_min = n_block_min + int(int64_t(n) * index / parts);
    range.n_block_max = n_block_min + int(int64_t(n) * (index + 1) / parts);
    range.n_unmasked_end = min(max(n_unmasked_end, range.n_block_min), range.n_block_max);
    range.n_unmasked_begin = min(max(n_unmasked_begin, range.n_block_min), range.n_unmasked_end);
    return range;
  }
};

// Per-element half of the band for one query tile, reduced to three integers so that little state stays live in
// registers across the KV loop: tile row r sees keys [row0_col_lo + r, min(row0_col_hi + r, seqlen_k)).
struct TileMask {
  static constexpr int kUnbounded = 1 << 30;  // stands for a missing side; |row + col| stays far below 2^31
  int row0_col_lo;
  int row0_col_hi;
  int seqlen_k;

  // Sets invisible scores to -inf. scores_rc / coords_rc are the (row, col) views of one thread's score fragment and
  // of the identity tensor partitioned the same way (tile-local coordinates); n_start is the block's first key.
  template <typename ScoresRC, typename CoordsRC>
  __device__ __forceinline__ void apply(ScoresRC& scores_rc, const CoordsRC& coords_rc, int n_start) const {
    using namespace cute;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores_rc); ++mi) {
      const int row = get<0>(coords_rc(mi, 0));
      // Bounds shifted to block-local columns so that the inner loop compares against compile-time column offsets.
      const int begin = row0_col_lo - n_start + row;
      const int end = min(row0_col_hi + row, seqlen_k) - n_start;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores_rc); ++ni) {
        const int col = get<1>(coords_rc(0, ni));
        if (col < begin || col >= end) scores_rc(mi, ni) = -INFINITY;
      }
    }
  }
};

// The per-element half of the band for the rows one thread holds, each row's visible keys given outright:
// row r sees keys [col_lo[r], col_hi[r]). For kernels whose tile rows are not consecutive query positions (the sm90
// forward's packed GQA tiles); 2 * kRows integers, taken once per tile.
template <int kRows>
struct RowsMask {
  int col_lo[kRows];
  int col_hi[kRows];

  // As TileMask::apply, for the thread's kRows rows (size<0>(scores_rc) == kRows, in the same order).
  template <typename ScoresRC, typename CoordsRC>
  __device__ __forceinline__ void apply(ScoresRC& scores_rc, const CoordsRC& coords_rc, int n_start) const {
    using namespace cute;
    static_assert(decltype(size<0>(scores_rc))::value == kRows);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int begin = col_lo[mi] - n_start;
      const int end = col_hi[mi] - n_start;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores_rc); ++ni) {
        const int col = get<1>(coords_rc(0, ni));
        if (col < begin || col >= end) scores_rc(mi, ni) = -INFINITY;
      }
    }
  }
};

struct BandMask {
  int seqlen_q;
  int seqlen_k;
  int offset;  // Sk - Sq: aligns the last query with the last key
  int left;    // -1: unbounded (also after normalization, see the constructor)
  int right;   // -1: unbounded

  // A side that cannot exclude any key is made unbounded: right >= Sq already admits every key for every row, and
  // left >= Sk likewise. Besides skipping needless checks, this keeps every bound below ~2 * max(Sq, Sk), so the
  // int32 arithmetic never overflows whatever window the caller passes.
  __host__ __device__ BandMask(int seqlen_q_, int seqlen_k_, int window_left, int window_right)
      : seqlen_q(seqlen_q_),
        seqlen_k(seqlen_k_),
        offset(seqlen_k_ - seqlen_q_),
        left(window_left < 0 || window_left >= seqlen_k_ ? -1 : window_left),
        right(window_right < 0 || window_right >= seqlen_q_ ? -1 : window_right) {}

  // Visible keys of query row i are [col_begin(i), col_end(i)); empty when col_end <= col_begin.
  // Both ends are non-decreasing in i, which the block-range logic relies on.
  __host__ __device__ int col_begin(int row) const { return left < 0 ? 0 : max(0, row + offset - left); }
  __host__ __device__ int col_end(int row) const {
    return right < 0 ? seqlen_k : min(seqlen_k, row + offset + right + 1);
  }

  // Blocks for query rows [m_start, m_start + kBlockM) ∩ [0, Sq). Rows past Sq are ignored: their Q is zero-filled,
  // their scores finite, their outputs never stored. An empty range means every row of the tile is empty.
  template <int kBlockM, int kBlockN>
  __host__ __device__ KvBlockRange kv_blocks(int m_start) const {
    return kv_blocks_of_rows<kBlockN>(m_start, min(m_start + kBlockM, seqlen_q) - 1);
  }

  // Blocks for a tile whose rows are query positions in [first_row, last_row] (last_row < Sq), not necessarily
  // consecutive ones: a tile of packed GQA holds several heads' rows of the same positions. The classification
  // holds for any set of rows between the two because both ends of a row's key range grow with its position.
  template <int kBlockN>
  __host__ __device__ KvBlockRange kv_blocks_of_rows(int first_row, int last_row) const {
    const int first_key = col_begin(first_row);
    const int end_key = col_end(last_row);
    KvBlockRange range;
    range.n_block_min = first_key / kBlockN;
    range.n_block_max = end_key <= first_key ? range.n_block_min : ceil_div(end_key, kBlockN);
    // Block n is unmasked iff its last key is visible to the first row (and < Sk) and its first key to the last row.
    const int unmasked_key_end = col_end(first_row);
    const int unmasked_key_begin = left < 0 ? 0 : last_row + offset - left;
    const int unmasked_end = unmasked_key_end <= 0 ? 0 : unmasked_key_end / kBlockN;
    const int unmasked_begin = unmasked_key_begin <= 0 ? 0 : ceil_div(unmasked_key_begin, kBlockN);
    range.n_unmasked_end = min(max(unmasked_end, range.n_block_min), range.n_block_max);
    range.n_unmasked_begin = min(max(unmasked_begin, range.n_block_min), range.n_unmasked_end);
    return range;
  }

  __host__ __device__ TileMask tile_mask(int m_start) const {
    return {left < 0 ? -TileMask::kUnbounded : m_start + offset - left,
            right < 0 ? TileMask::kUnbounded : m_start + offset + right + 1, seqlen_k};
  }

  // The mask of kRows rows of one thread, given their query positions.
  template <int kRows>
  __host__ __device__ RowsMask<kRows> rows_mask(const int (&rows)[kRows]) const {
    RowsMask<kRows> mask;
    for (int r = 0; r < kRows; ++r) {
      mask.col_lo[r] = left < 0 ? -TileMask::kUnbounded : rows[r] + offset - left;
      mask.col_hi[r] = right < 0 ? seqlen_k : min(seqlen_k, rows[r] + offset + right + 1);
    }
    return mask;
  }
};

}  // namespace flashjax::common

// The causal / sliding-window band of docs/design.md §2.3 (bottom-right aligned), as the backward sees it. A CTA
// owns a block of keys and walks blocks of query rows, so the policy's two halves are transposed from the forward's:
//   1. which M blocks see at least one of the CTA's keys, and which of those need no per-element mask;
//   2. the per-element predicate, applied to score fragments in (row, col) view.
// Key j is visible to query i iff j < Sk, j <= i + (Sk - Sq) + right (right >= 0) and j >= i + (Sk - Sq) - left
// (left >= 0).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/band_mask.cuh"

namespace flashjax::common {

struct MBlockRange {
  int begin;
  int end;  // exclusive; end <= begin: no query row sees the keys
};

// The band itself (normalized window, col_begin / col_end per row) is the forward's BandMask; what differs is the
// direction the tiles are walked in.
struct BwdBandMask : BandMask {
  using BandMask::BandMask;

  // M blocks holding every query row that sees one of the keys [n_start, n_start + kBlockN) ∩ [0, Sk); the others
  // are never loaded. Row i sees one of those keys iff col_end(i) > n_start and col_begin(i) <= last key, which
  // solve to  i >= n_start - offset - right (right >= 0)  and  i <= last_key - offset + left (left >= 0).
  template <int kBlockM, int kBlockN>
  __host__ __device__ MBlockRange m_blocks(int n_start) const {
    const int last_key = min(n_start + kBlockN, seqlen_k) - 1;
    const int row_begin = right < 0 ? 0 : max(0, n_start - offset - right);
    const int row_end = left < 0 ? seqlen_q : min(seqlen_q, last_key - offset + left + 1);
    if (row_end <= row_begin) return {0, 0};
    return {row_begin / kBlockM, (row_end + kBlockM - 1) / kBlockM};
  }

  // True when some (row, col) of rows [m_start, m_start + kBlockM) x keys [n_start, n_start + kBlockN) is invisible.
  // Rows past Sq are ignored: the backward zero-fills their Q and dO and gives them lse = +inf, so their P is 0.
  template <int kBlockM, int kBlockN>
  __host__ __device__ bool needs_mask(int m_start, int n_start) const {
    const int last_row = min(m_start + kBlockM, seqlen_q) - 1;
    const int last_col = n_start + kBlockN - 1;
    return last_col >= seqlen_k || (right >= 0 && last_col > m_start + offset + right) ||
           (left >= 0 && n_start < last_row + offset - left);
  }

  // Sets invisible scores to -inf. scores_rc / coords_rc are the (row, col) views of one thread's score fragment and
  // of the identity tensor partitioned the same way (tile-local coordinates); m_start / n_start place the tile.
  template <typename ScoresRC, typename CoordsRC>
  __device__ __forceinline__ void apply(ScoresRC& scores_rc, const CoordsRC& coords_rc, int m_start,
                                        int n_start) const {
    using namespace cute;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores_rc); ++mi) {
      const int row = m_start + get<0>(coords_rc(mi, 0));
      // Column bounds shifted into tile-local coordinates so the inner loop compares compile-time column offsets.
      const int begin = col_begin(row) - n_start;
      const int end = col_end(row) - n_start;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores_rc); ++ni) {
        const int col = get<1>(coords_rc(0, ni));
        if (col < begin || col >= end) scores_rc(mi, ni) = -INFINITY;
      }
    }
  }

  // As apply, for scores computed transposed (S^T = K Q^T, the sm90 backward's swapAB): the views' rows are keys and
  // their columns query rows.
  template <typename ScoresRC, typename CoordsRC>
  __device__ __forceinline__ void apply_transposed(ScoresRC& scores_rc, const CoordsRC& coords_rc, int m_start,
                                                   int n_start) const {
    using namespace cute;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores_rc); ++ni) {
      const int row = m_start + get<1>(coords_rc(0, ni));
      const int begin = col_begin(row) - n_start;
      const int end = col_end(row) - n_start;
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(scores_rc); ++mi) {
        const int key = get<0>(coords_rc(mi, 0));
        if (key < begin || key >= end) scores_rc(mi, ni) = -INFINITY;
      }
    }
  }
};

}  // namespace flashjax::common

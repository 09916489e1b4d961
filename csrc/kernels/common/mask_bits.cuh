// The per-element half of a mask mod on the kernels (issue 38): the mod's packed bits (AttnShape::mask_bits, layout
// in flashjax/params.h) applied to one thread's score fragment. Only tiles that mask_bits_tiles.cuh classed partial
// run this; empty ones are skipped and full ones take the mask-free code.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "flashjax/params.h"

namespace flashjax::common {

// The bits of one (batch, query head): rows are query positions, a row mask_words words.
struct MaskBitsRows {
  const uint32_t* words;
  int words_per_row;
  int seqlen_q;

  static __device__ __forceinline__ MaskBitsRows of(const AttnShape& s, int batch, int head_q) {
    return {s.mask_bits + batch * s.mask_batch_stride + head_q * s.mask_head_stride, s.mask_words, s.seqlen_q};
  }

  // Sets the scores whose bit is 0 to -inf. scores_rc / coords_rc: the (row, col) views of the thread's fragment
  // and of the identity tensor partitioned the same way (tile-local); m_start / n_start place the tile, n_start a
  // multiple of 32 (kBlockN is). Each row's kBlockN / 32 words are read once; rows past Sq and words past the row
  // (keys >= Sk, which the band masks anyway) read as 0, so no index leaves the bits whatever the tile.
  template <int kBlockN, typename ScoresRC, typename CoordsRC>
  __device__ __forceinline__ void apply(ScoresRC& scores_rc, const CoordsRC& coords_rc, int m_start,
                                        int n_start) const {
    using namespace cute;
    static_assert(kBlockN % 32 == 0);
    constexpr int kWords = kBlockN / 32;
    const int first_word = n_start / 32;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores_rc); ++mi) {
      const int row = m_start + get<0>(coords_rc(mi, 0));
      uint32_t row_words[kWords];
      CUTE_UNROLL
      for (int w = 0; w < kWords; ++w) {
        const bool inside = row < seqlen_q && first_word + w < words_per_row;
        row_words[w] = inside ? words[int64_t(row) * words_per_row + first_word + w] : 0u;
      }
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores_rc); ++ni) {
        const int col = get<1>(coords_rc(0, ni));
        // A select chain over the few words, not an indexed register array (which would go to local memory).
        uint32_t word = row_words[0];
        CUTE_UNROLL
        for (int w = 1; w < kWords; ++w) word = (col >> 5) == w ? row_words[w] : word;
        if (((word >> (col & 31)) & 1u) == 0u) scores_rc(mi, ni) = -INFINITY;
      }
    }
  }

  // For scores computed transposed (S^T = K Q^T, the sm90 backward: the views' rows are keys, their columns query
  // rows), in two halves so that the loads can go out while the GEMM that computes the scores runs and only one
  // register stays live until the scores are there: keep_transposed packs the thread's bits, bit mi + ni * rows of
  // the view for score (mi, ni) (at most 32 scores a thread), and apply_keep sets the scores whose bit is 0 to -inf.
  // A wgmma accumulator thread holds keys r and r + 8 of a 16-aligned run, so its keys of one column share a word:
  // each column loads one word, and a second only where a key's word differs (never, for the wgmma layouts; the
  // check keeps any other layout right). Same bounds as apply: nothing is read past the bits.
  template <typename CoordsRC>
  __device__ __forceinline__ uint32_t keep_transposed(const CoordsRC& coords_rc, int m_start, int n_start) const {
    using namespace cute;
    constexpr int kRows = size<0>(CoordsRC{});
    static_assert(size(CoordsRC{}) <= 32, "one bit per score of the thread");
    uint32_t keep = 0u;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(coords_rc); ++ni) {
      const int row = m_start + get<1>(coords_rc(0, ni));
      const uint32_t* row_words = words + int64_t(row) * words_per_row;
      auto load = [&](int w) { return row < seqlen_q && w < words_per_row ? row_words[w] : 0u; };
      const int first_key = n_start + get<0>(coords_rc(0, 0));
      const uint32_t first_word = load(first_key >> 5);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int key = n_start + get<0>(coords_rc(mi, 0));
        const uint32_t word = (key >> 5) == (first_key >> 5) ? first_word : load(key >> 5);
        keep |= ((word >> (key & 31)) & 1u) << (mi + ni * kRows);
      }
    }
    return keep;
  }

  template <typename ScoresRC>
  __device__ __forceinline__ static void apply_keep(ScoresRC& scores_rc, uint32_t keep) {
    using namespace cute;
    constexpr int kRows = size<0>(ScoresRC{});
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores_rc); ++ni) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        if (((keep >> (mi + ni * kRows)) & 1u) == 0u) scores_rc(mi, ni) = -INFINITY;
      }
    }
  }
};

}  // namespace flashjax::common

// A mask mod on the sm90 tangent kernel (issue 39 on top of issue 38): the per-element mask of its kMaskMod
// variant's masked steps. The tangent walks per-tile block lists
// exactly as the sm90 forward's mask-mod kernel does (kernels/common/mask_block_lists.cuh: the band's blocks less the
// mod's empty tiles, the band-masked and partial ones first, then the full ones), listed for the tangent's own
// 128 x kBlockN tiles by the launcher before the kernel.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/mask_bits.cuh"

namespace flashjax::sm90 {

// The masked steps' mask of one consumer warpgroup: the band, then the mod's bits ANDed on top. coords_rc are
// warpgroup-local (row, col) positions and the band mask was built for the warpgroup's first row m_start; the bits'
// rows start there too (of(): the pointer moved to row m_start, the row bound Sq - m_start), so both agree on which
// query row a fragment row is, and no register holds m_start (the D 256 variant spilled a few bytes with one more).
// Masked positions become -inf, hence P = 0 and W = 0: they add nothing to t_out or t_lse.
template <int kBlockN>
struct TangentBandAndBitsMask {
  common::TileMask band;
  common::MaskBitsRows bits;  // rows from m_start on

  __device__ __forceinline__ static TangentBandAndBitsMask of(const common::TileMask& band,
                                                              const common::MaskBitsRows& rows, int m_start) {
    common::MaskBitsRows from_m_start = rows;
    from_m_start.words += int64_t(m_start) * rows.words_per_row;
    from_m_start.seqlen_q -= m_start;  // rows past Sq still read as 0: the pointer is never dereferenced there
    return {band, from_m_start};
  }

  template <typename ScoresRC, typename CoordsRC>
  __device__ __forceinline__ void apply(ScoresRC& scores_rc, const CoordsRC& coords_rc, int n_start) const {
    band.apply(scores_rc, coords_rc, n_start);
    bits.template apply<kBlockN>(scores_rc, coords_rc, 0, n_start);
  }
};

}  // namespace flashjax::sm90

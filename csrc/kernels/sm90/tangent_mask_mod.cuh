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
// warpgroup-local (row, col) positions, the band mask was built for the warpgroup's first row m_start, and the bits
// are read at m_start + row, so both agree on which query row a fragment row is. Masked positions become -inf, hence
// P = 0 and W = 0: they add nothing to t_out or t_lse.
template <int kBlockN>
struct TangentBandAndBitsMask {
  common::TileMask band;
  common::MaskBitsRows bits;
  int m_start;

  template <typename ScoresRC, typename CoordsRC>
  __device__ __forceinline__ void apply(ScoresRC& scores_rc, const CoordsRC& coords_rc, int n_start) const {
    band.apply(scores_rc, coords_rc, n_start);
    bits.template apply<kBlockN>(scores_rc, coords_rc, m_start, n_start);
  }
};

}  // namespace flashjax::sm90

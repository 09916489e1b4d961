// Compile-time layouts of the sm80-family tangent kernel: the forward's MMA, swizzled shared-memory tiles and copy
// atoms (AttnTileLayouts, fwd_layouts.cuh) on tangent_tile_sizes()' tiles, and the shared-memory plan of its six
// tiles.
#pragma once

#include "kernels/sm80/fwd_layouts.cuh"
#include "kernels/sm80/tangent_tile_sizes.cuh"

namespace flashjax::sm80 {

template <typename Element, int kHeadDim, int kSmemKB>
inline constexpr TangentTileSizes kTangentTile = tangent_tile_sizes<Element>(kHeadDim, kSmemKB);

template <typename Element_, int kHeadDim_, int kSmemKB_>
struct TangentLayouts
    : AttnTileLayouts<Element_, kHeadDim_, kTangentTile<Element_, kHeadDim_, kSmemKB_>.block_m,
                      kTangentTile<Element_, kHeadDim_, kSmemKB_>.block_n,
                      kTangentTile<Element_, kHeadDim_, kSmemKB_>.warps> {
  using Base = AttnTileLayouts<Element_, kHeadDim_, kTangentTile<Element_, kHeadDim_, kSmemKB_>.block_m,
                               kTangentTile<Element_, kHeadDim_, kSmemKB_>.block_n,
                               kTangentTile<Element_, kHeadDim_, kSmemKB_>.warps>;
  static constexpr int kSmemKB = kSmemKB_;
  static constexpr TangentTileSizes kTile = kTangentTile<Element_, kHeadDim_, kSmemKB_>;
  // Element offsets of the tiles, in this order: Q, tQ (SmemLayoutQ), then K, tK, V, tV (SmemLayoutKV), one buffer
  // each. After the KV loop Q's buffer stages t_out for the store (fwd_epilogue_sm80) and tQ's holds the forward's
  // O tile (tangent_epilogue.cuh).
  static constexpr int kOffsetTq = Base::kSmemElemsQ;
  static constexpr int kOffsetK = 2 * Base::kSmemElemsQ;
  static constexpr int kOffsetTk = kOffsetK + Base::kSmemElemsKV;
  static constexpr int kOffsetV = kOffsetK + 2 * Base::kSmemElemsKV;
  static constexpr int kOffsetTv = kOffsetK + 3 * Base::kSmemElemsKV;
  static constexpr int kSmemBytes = (kOffsetK + 4 * Base::kSmemElemsKV) * int(sizeof(Element_));
  static_assert(kSmemBytes == tangent_tile_smem_bytes(kTile, kHeadDim_), "the tile choice sized what is carved here");
  static_assert(kSmemBytes <= kSmemKB * 1024, "no configuration of tangent_tile_sizes fits this budget");
};

}  // namespace flashjax::sm80

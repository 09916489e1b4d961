// Compile-time layouts of the sm80-family forward kernel: the MMA, shared-memory tiles and the copy atoms
// between global memory, shared memory and registers. Everything here follows from fwd_tile_sizes() for the head
// dim and the instantiation's shared-memory budget (kSmemKB). The tile-shape part (AttnTileLayouts) is shared with
// the tangent kernel (tangent_layouts.cuh), which runs the same MMAs, copies and epilogue on its own tile sizes.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/sm80/fwd_tile_sizes.cuh"

namespace flashjax::sm80 {

// Everything that follows from (Element, D, block_m x block_n tiles, warps): query tiles of kBlockM rows over
// kBlockN-key steps, kNWarps warps each owning kBlockM / kNWarps rows.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct AttnTileLayouts {
  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>,
                "flashjax kernels take fp16 or bf16");
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "compiled head dims are multiples of 32 up to 256");

  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kBlockM % (16 * kNWarps) == 0, "warps tile M in 16-row MMA steps");
  static_assert(kBlockN % 16 == 0, "P must form whole k16 A tiles");
  // Accumulator rows held by one thread: each 16-row MMA step gives a thread rows r and r + 8.
  static constexpr int kRowsPerThread = 2 * kBlockM / (16 * kNWarps);

  // Warps split M; each warp runs the whole N and K extent. The N permutation of 16 lets one ldmatrix.x4 feed
  // two n8 MMAs for B.
  using MmaAtom = cute::MMA_Atom<std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                                    cute::SM80_16x8x16_F32F16F16F32_TN,
                                                    cute::SM80_16x8x16_F32BF16BF16F32_TN>>;
  using TiledMma = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  // Shared memory tiles are built from 8-row x kBlockKSmem-column swizzled atoms: rows of 64 elements (128 bytes)
  // with Swizzle<3, 3, 3> make both the 16-byte cp.async stores and the ldmatrix row reads bank-conflict free.
  // D = 96 is not a multiple of 64, so it uses 32-element (64-byte) rows with the matching Swizzle<2, 3, 3>.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzleBits, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>, cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V^T (D x kBlockN) is the B operand of O += P V: the same bytes as V read transposed (ldmatrix .trans).
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));
  // O is staged through Q's buffer (Q is dead once the last S = Q K^T is done), so it shares Q's layout.
  using SmemLayoutO = SmemLayoutQ;

  static constexpr int kSmemElemsQ = kBlockM * kHeadDim;
  static constexpr int kSmemElemsKV = kBlockN * kHeadDim;

  // Shared memory -> registers for the MMAs: ldmatrix.x4 for row-major operands, ldmatrix.x4.trans for V^T.
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  // Registers -> shared memory for O: each thread holds pairs of adjacent columns, stored 32 bits at a time.
  using SmemCopyAtomO = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global <-> shared: each thread moves 16 bytes (8 elements); a row of kBlockKSmem elements is covered by
  // kBlockKSmem / 8 consecutive threads, so a warp touches whole 128-byte (or 64-byte) lines.
  static constexpr int kGmemElemsPerAccess = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerAccess;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemThreadLayout =
      cute::Layout<cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                   cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemValueLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerAccess>>>;
  // cp.async.cg: 16-byte asynchronous copies that bypass L1 (K/V are streamed, and shared by the CTAs of a head
  // through L2).
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemThreadLayout{},
      GmemValueLayout{}));
  using GmemTiledCopyO = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemThreadLayout{},
      GmemValueLayout{}));
};

// The forward's tiles for (Element, D, budget).
template <typename Element, int kHeadDim, int kSmemKB>
inline constexpr FwdTileSizes kFwdTile = fwd_tile_sizes<Element>(kHeadDim, kSmemKB);

template <typename Element_, int kHeadDim_, int kSmemKB_>
struct FwdLayouts : AttnTileLayouts<Element_, kHeadDim_, kFwdTile<Element_, kHeadDim_, kSmemKB_>.block_m,
                                    kFwdTile<Element_, kHeadDim_, kSmemKB_>.block_n,
                                    kFwdTile<Element_, kHeadDim_, kSmemKB_>.warps> {
  using Base = AttnTileLayouts<Element_, kHeadDim_, kFwdTile<Element_, kHeadDim_, kSmemKB_>.block_m,
                               kFwdTile<Element_, kHeadDim_, kSmemKB_>.block_n,
                               kFwdTile<Element_, kHeadDim_, kSmemKB_>.warps>;
  static constexpr int kSmemKB = kSmemKB_;  // the budget the tiles are chosen for
  static constexpr FwdTileSizes kTile = kFwdTile<Element_, kHeadDim_, kSmemKB_>;
  // Q, one K and one V tile.
  static constexpr int kSmemBytes = (Base::kSmemElemsQ + 2 * Base::kSmemElemsKV) * int(sizeof(Element_));
  static_assert(kSmemBytes == fwd_tile_smem_bytes(kTile, kHeadDim_), "the tile choice sized what is carved here");
  static_assert(kSmemBytes <= kSmemKB * 1024, "no configuration of fwd_tile_sizes fits this budget");
};

}  // namespace flashjax::sm80

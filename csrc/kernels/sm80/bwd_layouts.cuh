// Compile-time layouts of the sm80-family backward kernel: the three tiled MMAs, the shared-memory tiles (and
// their transposed views) and the copy atoms between global memory, shared memory and registers. Everything
// here follows from bwd_tile_sizes() for the head dim and the instantiation's shared-memory budget (kSmemKB).
//
// Per step the CTA (one block of kBlockN keys) computes, for one block of kBlockM query rows:
//   S  = Q K^T      (kBlockM x kBlockN, reduce D)        TiledMmaSdP, A = Q, B = K
//   dP = dO V^T     (kBlockM x kBlockN, reduce D)        TiledMmaSdP, A = dO, B = V
//   dV += P^T dO    (kBlockN x D, reduce kBlockM)        TiledMmaDkv, A = P^T, B = dO^T
//   dK += dS^T Q    (kBlockN x D, reduce kBlockM)        TiledMmaDkv, A = dS^T, B = Q^T
//   dQ  = dS K      (kBlockM x D, reduce kBlockN)        TiledMmaDq,  A = dS, B = K^T
// mma.sync TN wants both operands K-major; an operand whose reduced dimension is not the contiguous one in
// shared memory (P^T, dS^T, dO^T, Q^T, K^T) is the same bytes read through a transposed view with ldmatrix.trans.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "kernels/sm80/bwd_tile_sizes.cuh"

namespace flashjax::sm80 {

template <typename Element_, int kHeadDim_, int kSmemKB_>
struct BwdLayouts {
  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>,
                "flashjax kernels take fp16 or bf16");
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "compiled head dims are multiples of 32 up to 256");
  static constexpr int kSmemKB = kSmemKB_;  // the budget the tiles are chosen for

  static constexpr BwdTileSizes kTile = bwd_tile_sizes(kHeadDim, kSmemKB);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kNWarps = kTile.warps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kStagesQ = kTile.stages_q;
  static constexpr int kStagesdO = kTile.stages_do;
  static constexpr bool kVInRegs = kTile.v_in_regs;
  static_assert((kStagesQ == 1 || kStagesQ == 2) && (kStagesdO == 1 || kStagesdO <= kStagesQ),
                "Q / dO buffers: 2 / 2, 2 / 1 or 1 / 1 (bwd_mainloop_sm80's load schedules)");
  static_assert(kBwdSeqlenQRounding % kBlockM == 0, "M blocks must tile the workspace's row padding");

  using MmaAtom = cute::MMA_Atom<std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                                    cute::SM80_16x8x16_F32F16F16F32_TN,
                                                    cute::SM80_16x8x16_F32BF16BF16F32_TN>>;
  // kWarpsM x (warps / kWarpsM) warps; the N permutation of 16 per warp lets one ldmatrix.x4 feed two n8 MMAs.
  template <int kWarpsM>
  using TiledMmaWarps =
      cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::Int<kNWarps / kWarpsM>, cute::_1>>,
                     cute::Tile<cute::Int<16 * kWarpsM>, cute::Int<16 * (kNWarps / kWarpsM)>, cute::_16>>;
  using TiledMmaSdP = TiledMmaWarps<kTile.atom_m_sdp>;
  using TiledMmaDkv = TiledMmaWarps<kTile.atom_n_dkv>;
  using TiledMmaDq = TiledMmaWarps<kTile.atom_m_dq>;
  static_assert(kBlockM % (16 * kTile.atom_m_sdp) == 0 && kBlockN % (16 * (kNWarps / kTile.atom_m_sdp)) == 0);
  static_assert(kBlockN % (16 * kTile.atom_n_dkv) == 0 && kHeadDim % (16 * (kNWarps / kTile.atom_n_dkv)) == 0);
  // dQ = dS K is computed kDqChunks column chunks at a time (see bwd_dq_chunk_cols).
  static constexpr int kDqCols = bwd_dq_chunk_cols(kBlockM, kHeadDim, kNThreads, kVInRegs ? 16 : 32);
  static constexpr int kDqChunks = kHeadDim / kDqCols;
  static_assert(kHeadDim % kDqCols == 0 && (kDqCols == kHeadDim || kDqCols % 64 == 0));
  static_assert(kBlockM % (16 * kTile.atom_m_dq) == 0 && kDqCols % (16 * (kNWarps / kTile.atom_m_dq)) == 0);

  // Shared memory tiles are built from 8-row swizzled atoms: rows of 64 elements (128 bytes) with
  // Swizzle<3, 3, 3> make the 16-byte cp.async stores and the ldmatrix reads (plain and .trans) bank-conflict
  // free. D = 96 is not a multiple of 64, so Q / dO / K / V use 32-element rows with Swizzle<2, 3, 3>.
  template <int kRowElems>
  using SwizzledAtom = decltype(cute::composition(
      cute::Swizzle<kRowElems == 64 ? 3 : 2, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kRowElems>>, cute::Stride<cute::Int<kRowElems>, cute::_1>>{}));
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  // P / dS rows (kBlockN elements) use 64-element atoms, or 32-element ones for 32-key CTAs.
  static constexpr int kBlockNSmem = kBlockN % 64 == 0 ? 64 : 32;
  static_assert(kBlockN % 32 == 0, "P / dS rows are whole swizzle atoms");

  // (rows, cols) tile and its (cols, rows) transposed view over the same bytes.
  template <typename Layout, int kRows, int kCols>
  using Transposed = decltype(cute::composition(
      Layout{}, cute::make_layout(cute::Shape<cute::Int<kCols>, cute::Int<kRows>>{}, cute::GenRowMajor{})));

  using SmemLayoutQdO =  // one stage of Q or dO: kBlockM x D
      decltype(cute::tile_to_shape(SwizzledAtom<kBlockKSmem>{},
                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutQdOt = Transposed<SmemLayoutQdO, kBlockM, kHeadDim>;
  using SmemLayoutKV =  // kBlockN x D; also stages dK / dV for the epilogue
      decltype(cute::tile_to_shape(SwizzledAtom<kBlockKSmem>{},
                                   cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKt = Transposed<SmemLayoutKV, kBlockN, kHeadDim>;
  using SmemLayoutPdS =  // P or dS: kBlockM x kBlockN, in Element
      decltype(cute::tile_to_shape(SwizzledAtom<kBlockNSmem>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutPdSt = Transposed<SmemLayoutPdS, kBlockM, kBlockN>;
  using SmemLayoutQdOtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutQdOt{}));
  using SmemLayoutKtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemLayoutPdStNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutPdSt{}));

  // Shared memory, in elements, carved in this order from one dynamic buffer (every piece is a multiple of
  // 8 elements, so 16-byte alignment holds throughout). With V in registers, P and dS sit in V's tile once the
  // mainloop has read V out of it.
  static constexpr int kElemsQdO = kBlockM * kHeadDim;
  static constexpr int kElemsKV = kBlockN * kHeadDim;
  static constexpr int kElemsPdS = kBlockM * kBlockN;
  static constexpr int kOffsetQ = 0;
  static constexpr int kOffsetdO = kOffsetQ + kStagesQ * kElemsQdO;
  static constexpr int kOffsetK = kOffsetdO + kStagesdO * kElemsQdO;
  static constexpr int kOffsetV = kOffsetK + kElemsKV;
  static constexpr int kOffsetP = kVInRegs ? kOffsetV : kOffsetV + kElemsKV;
  static constexpr int kOffsetdS = kOffsetP + kElemsPdS;
  static constexpr int kSmemElems = kVInRegs && kElemsKV > 2 * kElemsPdS ? kOffsetV + kElemsKV : kOffsetdS + kElemsPdS;
  static constexpr int kSmemBytes = kSmemElems * int(sizeof(Element));
  static_assert(kSmemBytes == bwd_tile_smem_bytes(kTile, kHeadDim), "the tile choice sized what is carved here");
  static_assert(kSmemBytes <= kSmemKB * 1024, "no configuration of bwd_tile_sizes fits this budget");

  // Shared memory -> registers: ldmatrix.x4 for K-major operands, ldmatrix.x4.trans for the transposed views.
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  // Registers -> shared memory for P, dS, dK, dV: accumulator fragments hold pairs of adjacent columns.
  using SmemCopyAtomStore = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global <-> shared: each thread moves 16 bytes (8 elements); a row of kBlockKSmem elements is covered by
  // kBlockKSmem / 8 consecutive threads, so a warp touches whole 128-byte (or 64-byte) lines.
  static constexpr int kGmemElemsPerAccess = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerAccess;
  using GmemThreadLayout =
      cute::Layout<cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                   cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemValueLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerAccess>>>;
  static_assert(kBlockM % (kNThreads / kGmemThreadsPerRow) == 0 && kBlockN % (kNThreads / kGmemThreadsPerRow) == 0);
  // cp.async.cg with zero fill: rows past the sequence end arrive as zeros (finite scores, zero products)
  // without touching memory.
  using GmemTiledCopyLoad = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemThreadLayout{},
      GmemValueLayout{}));
  using GmemTiledCopyStore = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemThreadLayout{},
      GmemValueLayout{}));
};

}  // namespace flashjax::sm80

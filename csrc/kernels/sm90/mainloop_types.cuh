// The types that the sm90 forward and tangent mainloops (and through the tangent's, the fused jvp's) share:
// one warpgroup's GEMMs, the swizzled shared layouts TMA writes and wgmma reads, the K / V stage rings and the TMA
// types of the global tensors. One definition, so that the kernels cannot drift apart in how they lay out and read
// Q, K and V. Each mainloop derives from it and re-declares the names it uses (a dependent base's members are not
// found unqualified).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

namespace flashjax::sm90 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStagesK_, int kStagesV_>
struct MainloopTypesSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStagesK = kStagesK_;
  static constexpr int kStagesV = kStagesV_;
  static constexpr int kRowsPerWarpgroup = 64;  // the M of one wgmma

  using HeadDim = cute::Int<kHeadDim>;
  using BlockN = cute::Int<kBlockN>;
  using WgRows = cute::Int<kRowsPerWarpgroup>;

  // One warpgroup's GEMMs: S = Q K^T with both operands in shared memory (SS), O += P V with P in registers (RS).
  // V is stored as loaded (D contiguous), which makes it the MN-major B operand of P V.
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<WgRows, BlockN, HeadDim>>()));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<WgRows, HeadDim, BlockN>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>()));

  // Swizzled shared layouts in the canonical wgmma forms (the same swizzle is what TMA writes).
  using SmemLayoutAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element,
                                                                                       WgRows, HeadDim>());
  using SmemLayoutQHalf = decltype(cute::tile_to_shape(SmemLayoutAtomQ{}, cute::Shape<WgRows, HeadDim>{}));
  using SmemLayoutAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K, Element,
                                                                                       BlockN, HeadDim>());
  using SmemLayoutK = decltype(cute::tile_to_shape(SmemLayoutAtomK{},
                                                   cute::Shape<BlockN, HeadDim, cute::Int<kStagesK>>{}));
  // V^T view (D, kBlockN, stage) of the row-major V tile: D is the contiguous (MN) mode.
  using SmemLayoutAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::MN,
                                                                                        Element, HeadDim, BlockN>());
  using SmemLayoutVt = decltype(cute::tile_to_shape(SmemLayoutAtomVt{},
                                                    cute::Shape<HeadDim, BlockN, cute::Int<kStagesV>>{},
                                                    cute::Step<cute::_2, cute::_1, cute::_3>{}));

  static constexpr int kQHalfElems = cute::cosize_v<SmemLayoutQHalf>;  // one warpgroup's 64 rows

  using PipelineK = cutlass::PipelineTmaAsync<kStagesK>;
  using PipelineV = cutlass::PipelineTmaAsync<kStagesV>;
  using StateK = cutlass::PipelineState<kStagesK>;
  using StateV = cutlass::PipelineState<kStagesV>;

  // Global tensors as TMA sees them: (seqlen, D, heads, batch) for Q and K, (D, seqlen, heads, batch) for V^T.
  // One descriptor covers every batch and head; 64-bit strides.
  using ShapeSDHB = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideSDHB = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using StrideDSHB = cute::Stride<cute::_1, int64_t, int64_t, int64_t>;
  using GmemTensorQK = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                  ShapeSDHB{}, StrideSDHB{}));
  using GmemTensorVt = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                  ShapeSDHB{}, StrideDSHB{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorQK{}, SmemLayoutQHalf{},
                                            cute::Shape<WgRows, HeadDim>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorQK{},
                                            cute::take<0, 2>(SmemLayoutK{}), cute::Shape<BlockN, HeadDim>{},
                                            cute::_1{}));
  using TmaVt = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensorVt{},
                                             cute::take<0, 2>(SmemLayoutVt{}), cute::Shape<HeadDim, BlockN>{},
                                             cute::_1{}));

  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);  // one K or V tile
};

}  // namespace flashjax::sm90

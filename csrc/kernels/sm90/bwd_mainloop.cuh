// Mainloop of the sm90 backward kernel: the producer's TMA loads, the MMA warpgroups' step, the dQ writer's
// bulk reductions. FlashAttention-3's organisation, in this library's terms.
//
// A CTA owns kBlockN keys of one KV head (K_j, V_j loaded once) and walks its steps: every (query head of the GQA
// group, query block that sees one of the keys), heads outer (Steps). Per step, with Q_i and dO_i (and their rows'
// LSE and D' = rowsum(dO∘O) - dlse from the preprocess) arriving through two-stage TMA pipelines:
//   S^T  = K_j Q_i^T,  dP^T = V_j dO_i^T                 keys x queries: MMA warpgroup w owns keys 64w .. 64w + 63
//   P^T  = exp2(S^T * scale log2e - LSE log2e),  dS^T = P^T ∘ (dP^T - D') (∘ tanh' with softcap)
//   dV_j += P^T dO_i,  dK_j += dS^T Q_i                   P^T and dS^T straight from the accumulators (RS wgmma)
//   dQ_i  = dS K_j                                        dS through shared memory; staged in f32 for the writer
// Computing S and dP transposed ("swapAB") is what puts P^T and dS^T in registers in the A-operand form of the dK
// and dV GEMMs, which then need no shared-memory round trip; only dS goes to shared memory, for dQ, which needs all
// of the block's keys. dK and dV stay in registers for the whole sweep. The dQ writer warp adds each step's dQ into
// the f32 workspace with TMA bulk reduce-adds, off the MMA warpgroups' path; the postprocess converts it.
//
// Where dK + dV of 64 keys over all of D do not fit a warpgroup's registers (D > 128: bwd_tile_sizes.cuh's
// kByHeadDim), the CTA takes 64 keys and the warpgroups split the work differently: each computes S^T and dP^T for
// half of the query columns, P^T joins dS in shared memory, and each accumulates dK and dV of all 64 keys for half
// of D, with both operands of those GEMMs read from shared memory (SS wgmma). The rest of the step is the same.
//
// Rows past Sq are zero-filled by TMA and have lse_log2 = +inf (the preprocess pads the workspace so), so their P
// and dS are exactly 0; keys past Sk are zero-filled and masked (BwdBandMask::needs_mask covers the last block).
//
// Packed sequences (kVarlen, a compile-time variant so that the dense kernels' code is what it was): the CTA's keys
// and every step's rows are its sequence's (bwd_varlen_scheduler.cuh), the boxes start at the sequence's first row
// (from_row), the LSE / D' rows and dQ's workspace rows at its slab rows (slab_row). A box's rows past the
// sequence's used rows or keys but inside the tensor belong to a neighbour or are padding and may hold anything,
// NaN included. Masking S is not enough there: dP^T = V dO^T, dV += P^T dO, dK += dS^T Q and dQ = dS K would
// multiply those rows by P = 0 or dS = 0, and 0 * NaN is NaN. So the MMA warpgroups zero them in shared memory
// before any GEMM reads them (zero_rows: K and V once per CTA, Q and dO on the steps whose box reaches past the
// used rows, i.e. a sequence's last block). Then such rows are exactly the zero-filled rows of the dense case: S and
// dP are 0 there, padding rows have lse_log2 = +inf (P = 0), keys past the used ones are masked.
//
// A mask mod (kMaskMod, another compile-time variant; dense only, not with kVarlen): the steps of query head h are
// the entries of its list for the CTA's key block (MaskModSteps::blocks, common/mask_query_block_lists.cuh) instead
// of the band's whole range, so the mod's empty tiles are never loaded; on the steps the list flags partial, the
// MMA warpgroups load their bits while the S^T and dP^T GEMMs run (one packed word per thread) and set S^T to -inf
// where the mod's bit is 0 (after the band's own mask), which makes P^T and dS^T 0 there; full tiles run the band's
// code alone. A row that sees no key at all has lse = -inf, which the preprocess
// turns into lse_log2 = +inf, so its P is 0 on every tile and its gradients are 0, not NaN. The dQ writer and the
// producer walk the same lists, step for step.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "flashjax/params.h"
#include "kernels/common/bwd_band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/mask_bits.cuh"
#include "kernels/common/mask_query_block_lists.cuh"
#include "kernels/common/softcap.cuh"
#include "flashjax/workspace.h"
#include "kernels/sm90/bwd_dq_order.cuh"
#include "kernels/sm90/bwd_named_barriers.cuh"
#include "kernels/sm90/bwd_tile_sizes.cuh"
#include "kernels/sm90/bwd_varlen_scheduler.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

// dq_accum += the kBytes at smem, as one asynchronous bulk operation of the issuing thread's bulk group
// (cp.reduce.async.bulk ... add.f32): the reduction happens in L2, so the CTA neither waits for nor reads the
// old values. 16-byte aligned addresses, a multiple of 16 bytes.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const float* smem, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :
               : "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
#endif
}

// Waits until every bulk operation the thread committed has completed, its global writes included.
__device__ __forceinline__ void bulk_wait_all_complete() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

template <typename Element_, int kHeadDim_, bool kSoftcap_, bool kVarlen_ = false, bool kMaskMod_ = false>
struct BwdMainloopSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr BwdTileSizes kTiles = bwd_tile_sizes(kHeadDim);
  static constexpr int kBlockM = kTiles.block_m;
  static constexpr int kBlockN = kTiles.block_n;
  // Compiled for soft-capped calls (tanh' enters dS), as a kernel of its own like the forward's.
  static constexpr bool kSoftcap = kSoftcap_;
  // Packed sequences (see the header): the CTA's sequence rides along in Steps.
  static constexpr bool kVarlen = kVarlen_;
  // A mask mod (see the header): each (query head, key block) walks its list of query blocks; dense only.
  static constexpr bool kMaskMod = kMaskMod_;
  static_assert(!(kVarlen && kMaskMod), "varlen + mask mod runs on the reference");
  static constexpr int kMmaWarpgroups = BwdNamedBarrier::kMmaWarpgroups;
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;
  static constexpr int kStages = kTiles.stages;  // Q and dO buffers each
  // P^T and dS^T reach the dK / dV GEMMs through shared memory, which split D over the warpgroups.
  static constexpr bool kSplitByHeadDim = kTiles.split == BwdWarpgroupSplit::kByHeadDim;
  // S^T / dP^T are split over the warpgroups by keys (M) or by query columns (N); dK / dV by keys or by D.
  static constexpr int kSdpWarpgroupsM = kSplitByHeadDim ? 1 : kMmaWarpgroups;
  static constexpr int kSdpWarpgroupsN = kMmaWarpgroups / kSdpWarpgroupsM;
  static constexpr int kDkvWarpgroupsN = kSdpWarpgroupsN;
  static_assert(kBlockN == 64 * kSdpWarpgroupsM, "a warpgroup's keys are one wgmma M");
  static_assert(kBlockM == 64 || kBlockM == 128);
  static_assert(kBlockM % kBwdDqSemaphoreRows == 0, "a query block owns whole deterministic-mode counters");
  // dQ = dS K is split over the warpgroups by rows where a step has 128 of them, else by columns of D.
  static constexpr int kDqWarpgroupsM = kBlockM / 64;
  static constexpr int kDqWarpgroupsN = kMmaWarpgroups / kDqWarpgroupsM;
  // dQ GEMMs per step, each over a column slice of D (bwd_tile_sizes.cuh: with 2 the dQ accumulator is half the size).
  static constexpr int kDqPasses = kTiles.dq_passes;
  static_assert(kDqPasses == 1 || (kDqPasses == 2 && kSplitByHeadDim));

  using HeadDim = cute::Int<kHeadDim>;
  using BlockM = cute::Int<kBlockM>;
  using BlockN = cute::Int<kBlockN>;
  using Stages = cute::Int<kStages>;
  using DqPassShape = cute::Shape<BlockM, cute::Int<kHeadDim / kDqPasses>>;  // one dQ GEMM's share of the block
  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::Int<kMmaWarpgroups>, cute::_1, cute::_1>>;
  using WarpgroupsAlongN = cute::Layout<cute::Shape<cute::_1, cute::Int<kMmaWarpgroups>, cute::_1>>;

  // S^T = K Q^T and dP^T = V dO^T (keys x queries, K = D), both operands K-major in shared memory.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<BlockN, cute::Int<kBlockM / kSdpWarpgroupsN>, HeadDim>>(),
      cute::Layout<cute::Shape<cute::Int<kSdpWarpgroupsM>, cute::Int<kSdpWarpgroupsN>, cute::_1>>{}));
  // dV += P^T dO and dK += dS^T Q (keys x D, K = queries), B = dO / Q read transposed (MN-major). kByKeys: A from
  // registers. kByHeadDim: A = P^T / dS^T read from shared memory through the transposed view of P / dS (MN-major),
  // each warpgroup taking half of D.
  using TiledMmaDkvFromRegisters = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<BlockN, HeadDim, BlockM>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WarpgroupsAlongM{}));
  using TiledMmaDkvFromSmem = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<BlockN, cute::Int<kHeadDim / kMmaWarpgroups>, BlockM>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      WarpgroupsAlongN{}));
  using TiledMmaDkv = std::conditional_t<kSplitByHeadDim, TiledMmaDkvFromSmem, TiledMmaDkvFromRegisters>;
  // dQ = dS K (queries x D, K = keys): dS K-major, K read transposed (MN-major).
  using TiledMmaDq = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<BlockM, cute::Int<kHeadDim / kDqWarpgroupsN / kDqPasses>, BlockN>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::Int<kDqWarpgroupsM>, cute::Int<kDqWarpgroupsN>, cute::_1>>{}));

  // Shared layouts, in the canonical wgmma forms (the same swizzles TMA writes). A K-major swizzle atom read along
  // its other mode is the MN-major atom of the same swizzle, so one buffer serves both views: Q and dO as the K-major
  // B of S^T / dP^T and, transposed, as the MN-major B of dK / dV; K as the K-major A of S^T and, transposed, as the
  // MN-major B of dQ. Where the warpgroups of a GEMM each take half of D (dQ; dK / dV with kByHeadDim), the atom is
  // chosen no wider than that half, so that each half starts at an atom.
  using SmemLayoutAtomQdO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                     cute::GMMA::Major::K, Element, BlockM, cute::Int<kHeadDim / kDkvWarpgroupsN>>());
  using SmemLayoutQdO = decltype(cute::tile_to_shape(SmemLayoutAtomQdO{}, cute::Shape<BlockM, HeadDim, Stages>{}));
  using SmemLayoutQdOt = decltype(cute::composition(
      SmemLayoutQdO{}, cute::make_layout(cute::Shape<HeadDim, BlockM, Stages>{},
                                         cute::Stride<BlockM, cute::_1, cute::Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                   cute::GMMA::Major::K, Element, BlockN,
                                   cute::Int<kHeadDim / kDqWarpgroupsN / kDqPasses>>());
  using SmemLayoutK = decltype(cute::tile_to_shape(SmemLayoutAtomK{}, cute::Shape<BlockN, HeadDim>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<HeadDim, BlockN>{}, cute::Stride<BlockN, cute::_1>{})));
  using SmemLayoutAtomV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K,
                                                                                       Element, BlockN, HeadDim>());
  using SmemLayoutV = decltype(cute::tile_to_shape(SmemLayoutAtomV{}, cute::Shape<BlockN, HeadDim>{}));
  // dS (queries x keys, keys contiguous): the K-major A of dQ, written from the dS^T accumulators through the
  // transposed view with transposing stmatrix (8x8 16-bit blocks); with kByHeadDim that view is also the MN-major A
  // of dK, and P, stored the same way after dS, is read through it as the A of dV.
  using SmemLayoutAtomDs = decltype(cutlass::gemm::collective::detail::ss_smem_selector<cute::GMMA::Major::K,
                                                                                        Element, BlockM, BlockN>());
  using SmemLayoutDs = decltype(cute::tile_to_shape(SmemLayoutAtomDs{}, cute::Shape<BlockM, BlockN>{}));
  using SmemLayoutDst = decltype(cute::composition(
      SmemLayoutDs{}, cute::make_layout(cute::Shape<BlockN, BlockM>{}, cute::Stride<BlockM, cute::_1>{})));
  // dS buffers, alternating by step where the warpgroups split by keys: a step writes the buffer its predecessor's
  // predecessor read, whose dQ GEMMs both warpgroups had finished before arriving at the previous step's barrier, so
  // one 256-thread barrier a step (after the writes) suffices. kByHeadDim keeps one dS (shared memory is full there)
  // and the barrier before the writes, which also guards P.
  static constexpr int kDsStages = kSplitByHeadDim ? 1 : 2;
  using SmemLayoutDsStaged = decltype(cute::tile_to_shape(SmemLayoutAtomDs{},
                                                          cute::Shape<BlockM, BlockN, cute::Int<kDsStages>>{}));
  using SmemLayoutDstStaged = decltype(cute::composition(
      SmemLayoutDsStaged{}, cute::make_layout(cute::Shape<BlockN, BlockM, cute::Int<kDsStages>>{},
                                              cute::Stride<BlockM, cute::_1, cute::Int<kBlockM * kBlockN>>{})));
  static constexpr int kDsValuesPerThread = kBlockM * kBlockN / kMmaThreads;
  using SmemCopyAtomDs = cute::Copy_Atom<
      std::conditional_t<kDsValuesPerThread % 8 == 0, cute::SM90_U16x8_STSM_T, cute::SM90_U16x4_STSM_T>, Element>;

  // dQ staging: each MMA warpgroup's share of a step's dQ (kBlockM * D / 2 floats), in its accumulator fragment's
  // register order interleaved by thread: float4 j of thread t at (j * 128 + t) * 4, so a warp's 16-byte stores
  // cover 512 contiguous bytes. The workspace holds each query block in the same order (bulk copies are linear);
  // the postprocess reads it back with the same map.
  static constexpr int kDqPartFloats = kBlockM * kHeadDim / kMmaWarpgroups;

  static constexpr int kDsElements = cute::cosize_v<SmemLayoutDs>;
  static constexpr int kDsBuffers = kDsStages + (kSplitByHeadDim ? 1 : 0);  // dS stages, then P with kByHeadDim
  static_assert(kDsElements * sizeof(Element) % 1024 == 0, "P's buffer starts at a swizzle-aligned address");

  struct TensorStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQdO>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQdO>, 1024> dout;
    cute::array_aligned<Element, kDsBuffers * kDsElements, 1024> ds;  // dS stages, then P with kByHeadDim
    cute::array_aligned<float, kBlockM * kHeadDim, 128> dq;
    cute::array_aligned<float, kStages * kBlockM, 128> lse_log2;  // per stage: the Q rows' LSE in log2 units
    cute::array_aligned<float, kStages * kBlockM, 128> dpsum;     // per stage: the dO rows' D'
  };

  using PipelineQ = cutlass::PipelineTmaAsync<kStages>;   // Q_i and its LSE rows
  using PipelineDo = cutlass::PipelineTmaAsync<kStages>;  // dO_i and its D' rows
  using State = cutlass::PipelineState<kStages>;          // Q and dO advance together: one state serves both
  struct BarrierStorage {
    typename PipelineQ::SharedStorage q;
    typename PipelineDo::SharedStorage dout;
    cutlass::arch::ClusterTransactionBarrier kv;  // K_j and V_j, once
  };

  // Global tensors as TMA sees them: (seqlen, D, heads, batch), 64-bit strides; one descriptor for all heads.
  using ShapeSDHB = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideSDHB = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                ShapeSDHB{}, StrideSDHB{}));
  using TmaQdO = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutQdO{}),
                                              cute::Shape<BlockM, HeadDim>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                            cute::Shape<BlockN, HeadDim>{}, cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{},
                                            cute::Shape<BlockN, HeadDim>{}, cute::_1{}));

  static constexpr uint32_t kRowBytes = kBlockM * sizeof(float);  // one stage's LSE or D' rows
  static constexpr uint32_t kTmaBytesQdO = kBlockM * kHeadDim * sizeof(Element) + kRowBytes;
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
  static_assert(kRowBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

  struct Params {
    TmaQdO tma_q;
    TmaQdO tma_do;
    TmaK tma_k;
    TmaV tma_v;
    ShapeSDHB shape_q;  // (Sq, D, Hq, B), Sq clamped to >= 1 (a TMA dimension cannot be 0)
    ShapeSDHB shape_k;  // (Sk, D, Hk, B)
    const float* lse_log2;
    const float* dpsum;
    float* dq_accum;
    int* dq_semaphore;  // deterministic=True: the counters that order the dQ adds (bwd_dq_order.cuh); else nullptr
    int seqlen_q_rounded;
    int heads_q;
  };

  static Params to_params(const BwdParams& p) {
    using namespace cute;
    auto tensor = [](const void* ptr, int seqlen, int heads, int batch, int64_t row, int64_t head, int64_t bat) {
      return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                         ShapeSDHB{max(seqlen, 1), kHeadDim, heads, batch}, StrideSDHB{row, _1{}, head, bat});
    };
    const auto m_q = tensor(p.q, p.seqlen_q, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
    const auto m_do =
        tensor(p.dout, p.seqlen_q, p.heads_q, p.batch, p.do_row_stride, p.do_head_stride, p.do_batch_stride);
    const auto m_k = tensor(p.k, p.seqlen_k, p.heads_k, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
    const auto m_v = tensor(p.v, p.seqlen_k, p.heads_k, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
    return {make_tma_copy(SM90_TMA_LOAD{}, m_q, take<0, 2>(SmemLayoutQdO{}), Shape<BlockM, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, m_do, take<0, 2>(SmemLayoutQdO{}), Shape<BlockM, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, m_k, SmemLayoutK{}, Shape<BlockN, HeadDim>{}, _1{}),
            make_tma_copy(SM90_TMA_LOAD{}, m_v, SmemLayoutV{}, Shape<BlockN, HeadDim>{}, _1{}),
            shape(m_q),
            shape(m_k),
            p.lse_log2,
            p.dpsum,
            p.dq_accum,
            p.deterministic ? p.dq_semaphore : nullptr,
            p.seqlen_q_rounded,
            p.heads_q};
  }

  __device__ static void prefetch_tma_descriptors(const Params& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }

  // The CTA's steps: query heads [head_begin, head_begin + group) x query blocks [m_begin, m_end), heads outer. The
  // producer, the MMA warpgroups and the dQ writer walk the same list.
  struct DenseSteps {
    int head_begin;
    int group;
    int m_begin;
    int m_end;
    __device__ int num_steps() const { return m_end > m_begin ? group * (m_end - m_begin) : 0; }
    // The query blocks of head head_begin + h: steps t in [first(), last()), block m_block(t). Here the band's range
    // itself, read through the steps as the loops read it before lists existed, so that the dense kernels' code
    // stays what it was (copies of the bounds into locals changed their register allocation and spills).
    struct Blocks {
      const DenseSteps& steps;
      __device__ int first() const { return steps.m_begin; }
      __device__ int last() const { return steps.m_end; }
      __device__ int m_block(int t) const { return t; }
      __device__ bool partial(int) const { return false; }
    };
    __device__ Blocks blocks(int) const { return {*this}; }
    // First row of query block m_block of head_q in the workspace slabs ([B, Hq, Sq_rounded] per-row arrays;
    // dq_accum has D floats per row).
    __host__ __device__ static int64_t row_offset(int heads_q, int seqlen_q_rounded, int batch, int head_q,
                                                  int m_block) {
      return (int64_t(batch) * heads_q + head_q) * seqlen_q_rounded + int64_t(m_block) * kBlockM;
    }
  };
  // Varlen: also the CTA's sequence; m blocks and keys are sequence-local (the varlen fields exist only in the varlen
  // kernel, so that the dense kernels' registers are what they were).
  struct VarlenSteps : DenseSteps {
    BwdVarlenBlock seq;
  };
  // Mask mod: per query head of the group, the list of the query blocks this key block visits
  // (common/mask_query_block_lists.cuh, built from the band's range and the mod's tile classes): empty tiles left
  // out, partial ones flagged. Every role reads the same lists, so they walk the same steps.
  struct MaskModSteps : DenseSteps {
    const int32_t* lists;      // head head_begin's list of the CTA's (batch, key block)
    int64_t list_head_stride;  // ints to the next query head's list (0 where the bits broadcast over heads)
    common::MaskBitsRows bits;  // head head_begin's bits of the CTA's batch
    int64_t bits_head_stride;   // words to the next query head's bits (0 where they broadcast)
    using Blocks = common::ListedMBlocks;
    __device__ Blocks blocks(int h) const {
      const int32_t* list = lists + h * list_head_stride;
      return {list, list[0]};
    }
    __device__ common::MaskBitsRows bits_of(int h) const {
      return {bits.words + h * bits_head_stride, bits.words_per_row, bits.seqlen_q};
    }
    __device__ int num_steps() const {
      int steps = 0;
      for (int h = 0; h < this->group; ++h) steps += blocks(h).last();
      return steps;
    }
  };
  using Steps = std::conditional_t<kVarlen, VarlenSteps, std::conditional_t<kMaskMod, MaskModSteps, DenseSteps>>;
  using Lists = common::MaskQueryBlockLists<kBlockM, kBlockN>;

  __device__ static Steps make_steps(int head_begin, int group, const common::MBlockRange& m_blocks,
                                     const BwdVarlenBlock& seq, const AttnShape& call, int batch, int n_block) {
    if constexpr (kVarlen) {
      return {{head_begin, group, m_blocks.begin, m_blocks.end}, seq};
    } else if constexpr (kMaskMod) {
      return {{head_begin, group, m_blocks.begin, m_blocks.end}, Lists::list(call, batch, head_begin, n_block),
              Lists::head_stride(call), common::MaskBitsRows::of(call, batch, head_begin), call.mask_head_stride};
    } else {
      return {head_begin, group, m_blocks.begin, m_blocks.end};
    }
  }

  // First workspace row (LSE, D', dQ) of query block m_block of head_q: dense, the [B, Hq, Sq_rounded] slabs;
  // varlen, batch 0's slab from the sequence's rows on (flashjax/workspace.h).
  __device__ static int64_t slab_row(const Params& params, const Steps& steps, int batch, int head_q, int m_block) {
    if constexpr (kVarlen) {
      return Steps::row_offset(params.heads_q, params.seqlen_q_rounded, 0, head_q, m_block) + steps.seq.ws_start;
    } else {
      return Steps::row_offset(params.heads_q, params.seqlen_q_rounded, batch, head_q, m_block);
    }
  }

  // A (rows, D) global tensor (TMA coordinates) whose row 0 is the sequence's first query row or key (kKeys) where
  // kVarlen, else the tensor itself: the boxes then start at any row, not only at multiples of the block.
  template <bool kKeys, typename Tensor>
  __device__ __forceinline__ static auto from_row(const Tensor& tensor, const Steps& steps) {
    if constexpr (kVarlen) {
      return cute::domain_offset(cute::make_coord(kKeys ? steps.seq.k_start : steps.seq.q_start, cute::_0{}), tensor);
    } else {
      return tensor;
    }
  }

  // Zeroes rows [row_begin, row_end) of a (rows, D) shared-memory tile, in 16-byte runs of D (every swizzle mode
  // permutes whole 16-byte units, so each run is contiguous), thread `thread` of `threads`. Each run is addressed
  // through the tensor, whose swizzled pointer applies the swizzle to byte addresses as TMA and wgmma do, not by the
  // layout's function on an element coordinate (the forward's V-row bug: FwdMainloopSm90::zero_v_rows). Host and
  // device: tests/cpp/test_sm90_bwd_varlen.cu runs it against the hardware swizzle.
  template <typename TileRowsByD>
  __host__ __device__ static void zero_rows(TileRowsByD&& tile, int row_begin, int row_end, int thread, int threads) {
    constexpr int kVecElems = 16 / sizeof(Element);
    constexpr int kVecsPerRow = kHeadDim / kVecElems;
    static_assert(kHeadDim % kVecElems == 0);
    for (int i = thread + row_begin * kVecsPerRow; i < row_end * kVecsPerRow; i += threads) {
      *reinterpret_cast<uint4*>(&tile(i / kVecsPerRow, (i % kVecsPerRow) * kVecElems)) = make_uint4(0, 0, 0, 0);
    }
  }

  // ---- Producer: one thread (warp 0, lane 0 of the producer warpgroup) ----
  // K_j and V_j once, then Q_i + LSE rows and dO_i + D' rows of every step into the stage the pipelines hand out.
  // Q, dO and their rows are read by every KV block of the head: EVICT_LAST keeps them in L2 for the other CTAs.
  __device__ static void load(const Params& params, TensorStorage& tensors, BarrierStorage& barriers,
                              PipelineQ& pipeline_q, PipelineDo& pipeline_do, int n_block, int kv_head, int batch,
                              const Steps& steps) {
    using namespace cute;
    Tensor s_k = make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutK{});
    Tensor s_v = make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutV{});
    Tensor s_q = make_tensor(make_smem_ptr(tensors.q.data()), SmemLayoutQdO{});
    Tensor s_do = make_tensor(make_smem_ptr(tensors.dout.data()), SmemLayoutQdO{});
    auto tma_k = params.tma_k.get_slice(_0{});
    auto tma_v = params.tma_v.get_slice(_0{});
    auto tma_q = params.tma_q.get_slice(_0{});
    auto tma_do = params.tma_do.get_slice(_0{});
    Tensor g_k = local_tile(from_row<true>(params.tma_k.get_tma_tensor(params.shape_k)(_, _, kv_head, batch), steps),
                            Shape<BlockN, HeadDim>{}, make_coord(n_block, _0{}));
    Tensor g_v = local_tile(from_row<true>(params.tma_v.get_tma_tensor(params.shape_k)(_, _, kv_head, batch), steps),
                            Shape<BlockN, HeadDim>{}, make_coord(n_block, _0{}));
    auto& barrier_kv = reinterpret_cast<uint64_t&>(barriers.kv);
    barriers.kv.arrive_and_expect_tx(kTmaBytesKV);
    copy(params.tma_k.with(barrier_kv, 0, TMA::CacheHintSm90::EVICT_FIRST), tma_k.partition_S(g_k),
         tma_k.partition_D(s_k));
    copy(params.tma_v.with(barrier_kv, 0, TMA::CacheHintSm90::EVICT_FIRST), tma_v.partition_S(g_v),
         tma_v.partition_D(s_v));
    Tensor tQsQ = group_modes<0, 3>(tma_q.partition_D(s_q));     // (TMA, stage)
    Tensor tdOsdO = group_modes<0, 3>(tma_do.partition_D(s_do));  // (TMA, stage)

    State write = cutlass::make_producer_start_state<PipelineQ>();
    for (int h = 0; h < steps.group; ++h) {
      const int head_q = steps.head_begin + h;
      Tensor tQgQ = group_modes<0, 3>(tma_q.partition_S(local_tile(
          from_row<false>(params.tma_q.get_tma_tensor(params.shape_q)(_, _, head_q, batch), steps),
          Shape<BlockM, HeadDim>{}, make_coord(_, _0{}))));  // (TMA, m_blocks)
      Tensor tdOgdO = group_modes<0, 3>(tma_do.partition_S(local_tile(
          from_row<false>(params.tma_do.get_tma_tensor(params.shape_q)(_, _, head_q, batch), steps),
          Shape<BlockM, HeadDim>{}, make_coord(_, _0{}))));
      const auto blocks = steps.blocks(h);
      for (int t = blocks.first(); t < blocks.last(); ++t) {
        const int m_block = blocks.m_block(t);
        const int64_t rows = slab_row(params, steps, batch, head_q, m_block);
        const int stage = write.index();
        pipeline_q.producer_acquire(write);
        uint64_t* full_q = pipeline_q.producer_get_barrier(write);
        copy(params.tma_q.with(*full_q, 0, TMA::CacheHintSm90::EVICT_LAST), tQgQ(_, m_block), tQsQ(_, stage));
        SM90_BULK_COPY_G2S::copy(params.lse_log2 + rows, full_q, tensors.lse_log2.data() + stage * kBlockM,
                                 kRowBytes);
        pipeline_do.producer_acquire(write);
        uint64_t* full_do = pipeline_do.producer_get_barrier(write);
        copy(params.tma_do.with(*full_do, 0, TMA::CacheHintSm90::EVICT_LAST), tdOgdO(_, m_block),
             tdOsdO(_, stage));
        SM90_BULK_COPY_G2S::copy(params.dpsum + rows, full_do, tensors.dpsum.data() + stage * kBlockM, kRowBytes);
        ++write;
      }
    }
  }

  // ---- dQ writer: warp 1 of the producer warpgroup ----
  // Per step and MMA warpgroup: wait for its staged dQ share, bulk reduce-add it into the workspace, and once the
  // bulk operation has read the buffer, hand it back. The buffers start free (one arrival each up front). With
  // deterministic=True the step's adds wait for this CTA's turn at the query block and pass it on once complete; with
  // a mask mod the turn counts only the key blocks whose lists hold the block (call: the classes they came from).
  __device__ static void store_dq(const Params& params, TensorStorage& tensors, int batch, const Steps& steps,
                                  const common::BwdBandMask& mask, const BwdDqOrder& order, int n_block,
                                  int num_n_blocks, const AttnShape& call) {
    constexpr int kBarrierThreads = 128 + cutlass::NumThreadsPerWarp;
    const bool issuer = cute::elect_one_sync();
    CUTE_UNROLL
    for (int w = 0; w < kMmaWarpgroups; ++w) {
      cutlass::arch::NamedBarrier::arrive(kBarrierThreads, BwdNamedBarrier::dq_empty(w));
    }
    for (int h = 0; h < steps.group; ++h) {
      const auto blocks = steps.blocks(h);
      for (int t = blocks.first(); t < blocks.last(); ++t) {
        const int m_block = blocks.m_block(t);
        const int64_t rows = slab_row(params, steps, batch, steps.head_begin + h, m_block);
        float* block = params.dq_accum + rows * kHeadDim;
        int* counter = nullptr;
        int turn = 0;
        if (order.enabled()) {  // counted while the MMA warpgroups still work on the step
          if constexpr (kMaskMod) {
            const common::NonEmptyTiles listed{
                common::MaskTileClasses<kBlockM, kBlockN>::row(call, batch, steps.head_begin + h, m_block)};
            turn = order.rank<kBlockM, kBlockN>(mask, n_block, num_n_blocks, m_block, listed);
          } else {
            turn = order.rank<kBlockM, kBlockN>(mask, n_block, num_n_blocks, m_block);
          }
          counter = order.semaphores + rows / kBwdDqSemaphoreRows;  // one counter per 64 rows of the slabs
        }
        CUTE_UNROLL
        for (int w = 0; w < kMmaWarpgroups; ++w) {
          cutlass::arch::NamedBarrier::sync(kBarrierThreads, BwdNamedBarrier::dq_full(w));
          if (issuer) {
            if (w == 0 && counter != nullptr) BwdDqOrder::wait_turn(counter, turn);
            bulk_reduce_add_f32(block + w * kDqPartFloats, tensors.dq.data() + w * kDqPartFloats,
                                kDqPartFloats * sizeof(float));
            cute::tma_store_arrive();  // commits the bulk group
          }
        }
        // Warpgroup w's buffer is free once its group (the w-th of the step's) has been read.
        cute::for_each(cute::make_int_sequence<kMmaWarpgroups>{}, [&](auto w) {
          if (issuer) cute::tma_store_wait<kMmaWarpgroups - 1 - decltype(w)::value>();
          __syncwarp();
          cutlass::arch::NamedBarrier::arrive(kBarrierThreads, BwdNamedBarrier::dq_empty(decltype(w)::value));
        });
        if (issuer && counter != nullptr) {
          bulk_wait_all_complete();  // the adds themselves, not only their reads of shared memory
          BwdDqOrder::pass_turn(counter);
        }
      }
    }
    if (issuer) bulk_wait_all_complete();
  }

  // ---- MMA warpgroups: thread_idx in [0, kMmaThreads) ----
  // Runs every step, accumulating unscaled dK and dV (TiledMmaDkv fragments of kBlockN x D, zero on entry).
  template <typename AccDkv>
  __device__ static void mma(const Params& params, TensorStorage& tensors, BarrierStorage& barriers,
                             PipelineQ& pipeline_q, PipelineDo& pipeline_do, const common::BwdBandMask& mask,
                             const common::ScoreTransform& transform, int n_block, const Steps& steps,
                             int thread_idx, AccDkv& acc_dk, AccDkv& acc_dv) {
    using namespace cute;
    const int warpgroup = thread_idx / 128;
    const int thread_in_wg = thread_idx % 128;
    const int n_start = n_block * kBlockN;
    Tensor s_q = make_tensor(make_smem_ptr(tensors.q.data()), SmemLayoutQdO{});
    Tensor s_do = make_tensor(make_smem_ptr(tensors.dout.data()), SmemLayoutQdO{});
    Tensor s_qt = make_tensor(make_smem_ptr(tensors.q.data()), SmemLayoutQdOt{});
    Tensor s_dot = make_tensor(make_smem_ptr(tensors.dout.data()), SmemLayoutQdOt{});
    Tensor s_k = make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutK{});
    Tensor s_kt = make_tensor(make_smem_ptr(tensors.k.data()), SmemLayoutKt{});
    Tensor s_v = make_tensor(make_smem_ptr(tensors.v.data()), SmemLayoutV{});
    Tensor s_ds = make_tensor(make_smem_ptr(tensors.ds.data()), SmemLayoutDsStaged{});
    Tensor s_dst = make_tensor(make_smem_ptr(tensors.ds.data()), SmemLayoutDstStaged{});

    TiledMmaSdP mma_sdp;
    TiledMmaDkv mma_dkv;
    TiledMmaDq mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread_idx);
    auto thr_dkv = mma_dkv.get_thread_slice(thread_idx);
    auto thr_dq = mma_dq.get_thread_slice(thread_idx);
    Tensor tSrK = thr_sdp.partition_fragment_A(s_k);     // (MMA, MMA_M, MMA_K) descriptors
    Tensor tSrQ = thr_sdp.partition_fragment_B(s_q);     // (MMA, MMA_N, MMA_K, stage)
    Tensor tdPrV = thr_sdp.partition_fragment_A(s_v);
    Tensor tdPrdO = thr_sdp.partition_fragment_B(s_do);
    Tensor tdVrdO = thr_dkv.partition_fragment_B(s_dot);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tdKrQ = thr_dkv.partition_fragment_B(s_qt);
    Tensor tdQrdS = thr_dq.partition_fragment_A(s_ds);  // (MMA, MMA_M, MMA_K, ds stage)
    Tensor tdQrK = thr_dq.partition_fragment_B(s_kt);
    auto copy_ds = make_tiled_copy_C(SmemCopyAtomDs{}, mma_sdp);
    auto thr_copy_ds = copy_ds.get_thread_slice(thread_idx);
    Tensor tdSsdS = thr_copy_ds.partition_D(as_position_independent_swizzle_tensor(s_dst));  // (CPY, M, N, ds stage)
    // kByHeadDim: P's stmatrix destination, and the shared-memory A operands (descriptors) of dV and dK.
    Element* const p_buffer = tensors.ds.data() + kDsStages * kDsElements;
    auto tPsP = [&] {
      if constexpr (kSplitByHeadDim) {
        return thr_copy_ds.partition_D(
            as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(p_buffer), SmemLayoutDst{})));
      } else {
        return 0;
      }
    }();
    auto smem_a_dkv = [&](Element* buffer) {
      if constexpr (kSplitByHeadDim) {
        return thr_dkv.partition_fragment_A(make_tensor(make_smem_ptr(buffer), SmemLayoutDst{}));
      } else {
        return 0;
      }
    };
    auto tdVsP = smem_a_dkv(p_buffer);
    auto tdKsdS = smem_a_dkv(tensors.ds.data());
    // (key, query) of each S^T value this thread holds, tile-local, in (row, col) view: rows are keys.
    Tensor coords_rc = common::wgmma_acc_rowcol_view(thr_sdp.partition_C(make_identity_tensor(Shape<BlockN, BlockM>{})));
    float* dq_part = tensors.dq.data() + warpgroup * kDqPartFloats;

    barriers.kv.wait(0);
    if constexpr (kVarlen) {  // K / V rows past the used keys (a neighbour's, or padding), once: see the header
      const int past_begin = steps.seq.seqlen_k - n_start;  // > 0: the CTA has keys
      const int past_end = min(kBlockN, steps.seq.k_rows - n_start);  // rows past the tensor are TMA's zero fill
      if (past_begin < past_end) {
        zero_rows(s_k, past_begin, past_end, thread_idx, kMmaThreads);
        zero_rows(s_v, past_begin, past_end, thread_idx, kMmaThreads);
        cutlass::arch::fence_view_async_shared();  // the zeros, visible to the wgmma reads (async proxy)
        __syncwarp();  // the lanes' loops end apart: reconverge before the barrier
        cutlass::arch::NamedBarrier::sync(kMmaThreads, BwdNamedBarrier::kDsSync);
      }
    }
    State read;
    int ds_stage = 0;
    for (int h = 0; h < steps.group; ++h) {
      const auto blocks = steps.blocks(h);
      CUTE_NO_UNROLL
      for (int t = blocks.first(); t < blocks.last(); ++t) {
        // A mask mod's step: its list entry read once, before the waits (block and flag in one global load).
        [[maybe_unused]] int entry = 0;
        if constexpr (kMaskMod) entry = blocks.entry(t);
        const int m_block = kMaskMod ? common::ListedMBlocks::m_block_of(entry) : blocks.m_block(t);
        [[maybe_unused]] const bool partial = kMaskMod && common::ListedMBlocks::partial_of(entry);
        const int m_start = m_block * kBlockM;
        const int stage = read.index();
        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
        if constexpr (kVarlen) {  // Q / dO rows past the used rows, on a sequence's last block: see the header
          const int past_begin = steps.seq.seqlen_q - m_start;  // > 0: the block holds used rows
          const int past_end = min(kBlockM, steps.seq.q_rows - m_start);
          if (past_begin < past_end) {  // the same for every MMA thread: all of them reach the barrier
            pipeline_q.consumer_wait(read);
            pipeline_do.consumer_wait(read);
            zero_rows(s_q(_, _, stage), past_begin, past_end, thread_idx, kMmaThreads);
            zero_rows(s_do(_, _, stage), past_begin, past_end, thread_idx, kMmaThreads);
            cutlass::arch::fence_view_async_shared();
            __syncwarp();
            cutlass::arch::NamedBarrier::sync(kMmaThreads, BwdNamedBarrier::kDsSync);
          }
        }
        pipeline_q.consumer_wait(read);
        common::wgmma_gemm</*kZeroInit=*/true, /*kWaitGroups=*/-1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
        pipeline_do.consumer_wait(read);
        common::wgmma_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
        // A partial tile of the mask mod: the thread's bits, loaded while the GEMMs run (applied after the band's).
        [[maybe_unused]] uint32_t keep = ~0u;
        if constexpr (kMaskMod) {
          if (partial) keep = steps.bits_of(h).keep_transposed(coords_rc, m_start, n_start);
        }
        warpgroup_wait<1>();  // S^T is complete; dP^T may still run
        warpgroup_fence_operand(acc_s);

        Tensor s_rc = common::wgmma_acc_rowcol_view(acc_s);
        // tanh' = 1 - t^2 of the capped scores, taken before the mask (t is finite there; the mask's -inf would
        // give NaN), applied to dS below.
        Tensor dtanh = make_tensor<float>(acc_s.layout());
        if constexpr (kSoftcap) {
          transform.apply_softcap(acc_s);
          CUTE_UNROLL
          for (int i = 0; i < size(acc_s); ++i) dtanh(i) = 1.f - acc_s(i) * acc_s(i);
        }
        if (mask.needs_mask<kBlockM, kBlockN>(m_start, n_start)) {
          mask.apply_transposed(s_rc, coords_rc, m_start, n_start);
        }
        if constexpr (kMaskMod) {  // the mod's bits on partial tiles, after the band (full tiles: the band alone)
          if (partial) common::MaskBitsRows::apply_keep(s_rc, keep);
        }
        // P^T = exp2(s * scale log2e - LSE log2e); each thread's columns are queries, 2 keys per column.
        const float* lse_log2 = tensors.lse_log2.data() + stage * kBlockM;
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s_rc); ++ni) {
          const float row_lse = lse_log2[get<1>(coords_rc(0, ni))];
          CUTE_UNROLL
          for (int mi = 0; mi < size<0>(s_rc); ++mi) {
            s_rc(mi, ni) = common::exp2_ftz(s_rc(mi, ni) * transform.exp2_scale - row_lse);
          }
        }
        Tensor r_p = make_tensor<Element>(common::wgmma_acc_as_a_layout(acc_s.layout()));
        common::convert_fragment_into(acc_s, r_p);

        warpgroup_wait<0>();  // dP^T
        warpgroup_fence_operand(acc_dp);
        Tensor dp_rc = common::wgmma_acc_rowcol_view(acc_dp);
        const float* dpsum = tensors.dpsum.data() + stage * kBlockM;
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(dp_rc); ++ni) {
          const float row_dpsum = dpsum[get<1>(coords_rc(0, ni))];
          CUTE_UNROLL
          for (int mi = 0; mi < size<0>(dp_rc); ++mi) dp_rc(mi, ni) = s_rc(mi, ni) * (dp_rc(mi, ni) - row_dpsum);
        }
        if constexpr (kSoftcap) {
          CUTE_UNROLL
          for (int i = 0; i < size(acc_dp); ++i) acc_dp(i) *= dtanh(i);
        }
        Tensor r_ds = make_tensor<Element>(common::wgmma_acc_as_a_layout(acc_dp.layout()));
        common::convert_fragment_into(acc_dp, r_ds);

        // dS^T (and P^T) into shared memory; with one dS buffer once both warpgroups' GEMMs of the previous step
        // have read it (kDsStages says why two buffers need no wait).
        if constexpr (kDsStages == 1) cutlass::arch::NamedBarrier::sync(kMmaThreads, BwdNamedBarrier::kDsSync);
        copy(copy_ds, thr_copy_ds.retile_S(make_tensor(r_ds.data(), acc_dp.layout())), tdSsdS(_, _, _, ds_stage));
        if constexpr (kSplitByHeadDim) {
          copy(copy_ds, thr_copy_ds.retile_S(make_tensor(r_p.data(), acc_s.layout())), tPsP);
        } else {
          common::wgmma_gemm<false, -1>(mma_dkv, r_p, tdVrdO(_, _, _, stage), acc_dv);
        }
        cutlass::arch::fence_view_async_shared();  // the stmatrix writes, visible to the wgmma reads of dS (and P)
        cutlass::arch::NamedBarrier::sync(kMmaThreads, BwdNamedBarrier::kDsSync);
        // kByHeadDim: dV's P^T holds both warpgroups' query columns, so its GEMM waits for the whole block.
        if constexpr (kSplitByHeadDim) common::wgmma_gemm<false, -1>(mma_dkv, tdVsP, tdVrdO(_, _, _, stage), acc_dv);

        auto gemm_dk = [&] {  // waits until one GEMM is in flight: the dQ GEMM issued before it is complete
          if constexpr (kSplitByHeadDim) {
            common::wgmma_gemm<false, 1>(mma_dkv, tdKsdS, tdKrQ(_, _, _, stage), acc_dk);
          } else {
            common::wgmma_gemm<false, 1>(mma_dkv, r_ds, tdKrQ(_, _, _, stage), acc_dk);
          }
        };
        // Stages dQ values at float4 index first_float4 of this warpgroup's share onwards (fragment order).
        auto stage_dq = [&](const auto& acc_dq, int first_float4) {
          CUTE_UNROLL
          for (int j = 0; j < size(acc_dq) / 4; ++j) {
            reinterpret_cast<float4*>(dq_part)[(first_float4 + j) * 128 + thread_in_wg] =
                make_float4(acc_dq(4 * j), acc_dq(4 * j + 1), acc_dq(4 * j + 2), acc_dq(4 * j + 3));
          }
        };
        Tensor acc_dq = partition_fragment_C(mma_dq, DqPassShape{});
        Tensor tdQrdS_step = tdQrdS(_, _, _, ds_stage);
        if constexpr (kDqPasses == 1) {
          common::wgmma_gemm<true, 1>(mma_dq, tdQrdS_step, tdQrK, acc_dq);  // waits for dV: dO is read
          pipeline_do.consumer_release(read);
          gemm_dk();
          warpgroup_fence_operand(acc_dq);
          // This warpgroup's dQ share to the writer warp, once it has taken the previous one.
          cutlass::arch::NamedBarrier::sync(128 + cutlass::NumThreadsPerWarp, BwdNamedBarrier::dq_empty(warpgroup));
          stage_dq(acc_dq, 0);
        } else {
          // Two column slices of dQ: the first is staged while the GEMM of dK runs, the second after it. The slices
          // are the TiledMmaDq's N tiles, so together they stage the fragment order of the whole share.
          auto dq_slice_b = [&](int slice) {
            return thr_dq.partition_fragment_B(local_tile(s_kt, Shape<Int<kHeadDim / kDqPasses>, BlockN>{},
                                                          make_coord(slice, _0{})));
          };
          Tensor tdQrK_first = dq_slice_b(0);
          common::wgmma_gemm<true, 1>(mma_dq, tdQrdS_step, tdQrK_first, acc_dq);  // waits for dV: dO is read
          pipeline_do.consumer_release(read);
          gemm_dk();
          warpgroup_fence_operand(acc_dq);
          cutlass::arch::NamedBarrier::sync(128 + cutlass::NumThreadsPerWarp, BwdNamedBarrier::dq_empty(warpgroup));
          stage_dq(acc_dq, 0);
          Tensor tdQrK_second = dq_slice_b(1);
          common::wgmma_gemm<true, 0>(mma_dq, tdQrdS_step, tdQrK_second, acc_dq);  // and dK before it
          stage_dq(acc_dq, size(acc_dq) / 4);
        }
        cutlass::arch::fence_view_async_shared();  // visible to the bulk reduce (async proxy)
        cutlass::arch::NamedBarrier::arrive(128 + cutlass::NumThreadsPerWarp, BwdNamedBarrier::dq_full(warpgroup));

        warpgroup_wait<0>();  // dK: Q is read
        warpgroup_fence_operand(acc_dk);
        pipeline_q.consumer_release(read);
        ++read;
        if constexpr (kDsStages == 2) ds_stage ^= 1;
      }
    }
  }
};

}  // namespace flashjax::sm90

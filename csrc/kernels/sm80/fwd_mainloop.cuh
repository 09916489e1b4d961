// Mainloop of the sm80-family forward kernel: cp.async loads of Q/K/V tiles into swizzled shared memory and, per KV
// block, S = Q K^T (both operands from shared memory through ldmatrix), softcap, band mask, online softmax and
// O += P V (P straight from registers, V^T through ldmatrix.trans).
//
// Pipeline (one K and one V buffer, FlashAttention-2 order), for each KV block n followed by block n':
//   wait K[n]  | issue V[n]  | S = Q K[n]^T         (V[n] lands under the first GEMM)
//   wait V[n]  | issue K[n'] | softmax, O += P V[n] (K[n'] lands under the softmax and the second GEMM)
// Blocks are visited in KvBlockRange order: first those needing the per-element band mask (the partial last block
// when Sk % kBlockN != 0, the causal diagonal, window edges), then the fully visible bulk in a second loop compiled
// without mask code, so that mask state takes no registers in the hot loop (with it, ptxas spilled at 255 registers).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/mask_bits.cuh"
#include "kernels/common/mask_bits_tiles.cuh"
#include "kernels/common/online_softmax.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm80/fwd_layouts.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"
#include "kernels/sm80/smem_gemm.cuh"

namespace flashjax::sm80 {

// Copies a (kRows x D) tile global -> shared with cp.async, rows at or past rows_valid being zero-filled in shared
// memory instead of read: padding never touches out-of-bounds memory, and zero K/V rows keep garbage (even NaN)
// out of the MMAs (a masked score's P is 0, but 0 * NaN is still NaN). kCheckRows = false: all rows are known valid.
template <bool kCheckRows, typename TiledCopy, typename Src, typename Dst, typename Coords>
__device__ __forceinline__ void copy_rows_zero_fill(const TiledCopy& tiled_copy, const Src& src, Dst&& dst,
                                                    const Coords& coords, int rows_valid) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    if (!kCheckRows || get<0>(coords(0, m, 0)) < rows_valid) {
      copy(tiled_copy, src(_, m, _), dst(_, m, _));
    } else {
      clear(dst(_, m, _));
    }
  }
}

// What the mainloop of one CTA needs besides its tiles.
struct FwdMainloopArgs {
  int rows_valid_q;  // Sq - m_start: tile rows at or past this are padding
  int seqlen_k;
  common::KvBlockRange blocks;  // non-empty
  common::TileMask mask;
  common::ScoreTransform transform;
};

// A mask mod's part (kMaskMod kernels only): the tile classes of this CTA's m-block, one per n-block
// (mask_bits_tiles.cuh), and the bits of its (batch, query head) for the partial blocks.
struct FwdMaskModArgs {
  const uint8_t* classes = nullptr;
  common::MaskBitsRows bits{};
  int m_start = 0;
};

// Softcap, then the band mask and (kMaskMod) the mod's bits on one block's scores, in the forward's order; shared
// with the tangent (tangent_mainloop.cuh), whose P must see exactly the forward's scores. apply_mask: compile-time
// bool, the block may be partly invisible. Returns acc_s's (row, col) view.
template <int kBlockN, bool kSoftcap, bool kMaskMod, typename ApplyMask, typename AccS, typename CoordsRC>
__device__ __forceinline__ auto mask_scores(ApplyMask, AccS& acc_s, const CoordsRC& tScS_rc,
                                            const FwdMainloopArgs& args, const FwdMaskModArgs& mod, int n_block) {
  if constexpr (kSoftcap) args.transform.apply_softcap(acc_s);
  auto acc_s_rc = common::acc_rowcol_view(acc_s);
  if constexpr (ApplyMask::value) args.mask.apply(acc_s_rc, tScS_rc, n_block * kBlockN);
  if constexpr (kMaskMod && ApplyMask::value) {
    mod.bits.template apply<kBlockN>(acc_s_rc, tScS_rc, mod.m_start, n_block * kBlockN);
  }
  return acc_s_rc;
}

// A mask mod's walk over the band's blocks, shared by the kMaskMod forward and tangent: visit t (the band's order)
// is masked when the band masks it or the mod's class is partial, full when the band does not and the mod's class
// is full, skipped when the class is empty. The caller visits the masked ones first (next_masked from 0), then the
// full ones (next_full from num_masked), and links the K prefetch chain through block_or_none. The loops stay in
// each mainloop: passing them the step and the first loads as lambdas (one walk function for both) changed the
// SASS of every sm80 tangent kernel, the mask-mod-free ones included.
struct MaskModWalk {
  const common::KvBlockRange& blocks;
  const uint8_t* classes;
  int num_blocks;
  int num_masked;
  __device__ MaskModWalk(const common::KvBlockRange& blocks_, const uint8_t* classes_)
      : blocks(blocks_), classes(classes_), num_blocks(blocks_.num_blocks()), num_masked(blocks_.num_masked()) {}
  __device__ int mod_class(int t) const { return classes[blocks.block_at(t)]; }
  __device__ int next_masked(int t) const {
    while (t < num_blocks &&
           (mod_class(t) == common::kMaskTileEmpty || (t >= num_masked && mod_class(t) == common::kMaskTileFull))) {
      ++t;
    }
    return t;
  }
  __device__ int next_full(int t) const {
    while (t < num_blocks && mod_class(t) != common::kMaskTileFull) ++t;
    return t;
  }
  __device__ int block_or_none(int t) const { return t < num_blocks ? blocks.block_at(t) : -1; }
};

// Runs the whole KV loop of one CTA. g_q: (kBlockM, D) tile; g_k, g_v: (kBlockN, D, n_blocks) tiles of the head.
// kSoftcap = false skips softcap entirely: only valid when args.transform.softcap <= 0 (see fwd_kernel.cuh for why
// it is a compile-time switch).
// kMaskMod: the call has mask bits (`mod`; ignored otherwise). Each block of the band's range then takes the class
// the band and the mod's tile class compose to: skipped (never loaded) when either says empty, the mask-free step
// when both say full, else the masked step with the band mask and the bits. Masked blocks still go first, then the
// full ones in a second loop without mask code; the K prefetch chain links the blocks actually visited.
// On return acc_o and softmax hold the unnormalized output and row statistics; Q's shared buffer is free (every
// thread is past the barrier that follows its last read), K/V buffers may still be read by the last P V. A tile with
// no block to visit (every one empty by the mod) returns at once, having loaded nothing.
template <typename Layouts, bool kSoftcap, bool kMaskMod, typename GQ, typename GK, typename GV, typename AccO,
          typename Softmax>
__device__ __forceinline__ void fwd_mainloop_sm80(const GQ& g_q, const GK& g_k, const GV& g_v,
                                                  const FwdMainloopArgs& args, const FwdMaskModArgs& mod,
                                                  typename Layouts::Element* smem, AccO& acc_o, Softmax& softmax) {
  using namespace cute;
  using Element = typename Layouts::Element;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kBlockN = Layouts::kBlockN;
  constexpr int kHeadDim = Layouts::kHeadDim;
  const int tid = threadIdx.x;

  Tensor s_q = make_tensor(make_smem_ptr(smem), typename Layouts::SmemLayoutQ{});
  Tensor s_k = make_tensor(s_q.data() + size(s_q), typename Layouts::SmemLayoutKV{});
  Tensor s_v = make_tensor(s_k.data() + size(s_k), typename Layouts::SmemLayoutKV{});
  Tensor s_vt = make_tensor(s_v.data(), typename Layouts::SmemLayoutVt{});
  Tensor s_vt_no_swizzle = make_tensor(s_v.data().get(), typename Layouts::SmemLayoutVtNoSwizzle{});

  // Global -> shared.
  typename Layouts::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr_copy.partition_S(g_q);
  Tensor tQsQ = gmem_thr_copy.partition_D(s_q);
  Tensor tKgK = gmem_thr_copy.partition_S(g_k);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKsK = gmem_thr_copy.partition_D(s_k);
  Tensor tVgV = gmem_thr_copy.partition_S(g_v);
  Tensor tVsV = gmem_thr_copy.partition_D(s_v);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Only masked blocks can reach past Sk (a block holding keys >= Sk is never unmasked), so only they check rows.
  auto load_k = [&](auto check_rows, int n_block) {
    copy_rows_zero_fill<decltype(check_rows)::value>(gmem_copy, tKgK(_, _, _, n_block), tKsK, tKVcKV,
                                                     args.seqlen_k - n_block * kBlockN);
  };
  auto load_v = [&](auto check_rows, int n_block) {
    copy_rows_zero_fill<decltype(check_rows)::value>(gmem_copy, tVgV(_, _, _, n_block), tVsV, tKVcKV,
                                                     args.seqlen_k - n_block * kBlockN);
  };

  // Shared -> registers and the MMAs.
  typename Layouts::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(s_q);
  Tensor tSrK = thr_mma.partition_fragment_B(s_k);
  Tensor tOrVt = thr_mma.partition_fragment_B(s_vt_no_swizzle);
  auto smem_copy_q = make_tiled_copy_A(typename Layouts::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_copy_q.partition_S(s_q);
  auto smem_copy_k = make_tiled_copy_B(typename Layouts::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_copy_k.partition_S(s_k);
  auto smem_copy_v = make_tiled_copy_B(typename Layouts::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_copy_v.partition_S(s_vt);

  // Tile-local (row, col) of each score this thread holds, for the band mask.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = common::acc_rowcol_view(tScS);
  Tensor acc_o_rc = common::acc_rowcol_view(acc_o);

  // One KV block: n_block is consumed, K[next_n_block] prefetched (next_n_block < 0: none). apply_mask is a
  // compile-time bool: whether this block (and, in the masked loop, the next one) may be partly invisible.
  auto kv_step = [&](auto apply_mask, int n_block, int next_n_block) {
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    // K[n] (and Q) have landed, and every thread is done reading the previous V: V's buffer may be refilled.
    cute::cp_async_wait<0>();
    __syncthreads();
    load_v(apply_mask, n_block);
    cute::cp_async_fence();

    gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k);
    Tensor acc_s_rc = mask_scores<kBlockN, kSoftcap, kMaskMod>(apply_mask, acc_s, tScS_rc, args, mod, n_block);

    // V[n] has landed, and every thread is done reading K[n]: K's buffer may be refilled.
    cute::cp_async_wait<0>();
    __syncthreads();
    if (next_n_block >= 0) {
      load_k(apply_mask, next_n_block);
      cute::cp_async_fence();
    }

    softmax.update(acc_s_rc, acc_o_rc);
    Tensor p = common::convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(p.data(), common::acc_as_a_operand_layout(p.layout()));
    gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v);
  };

  const common::KvBlockRange& blocks = args.blocks;
  if constexpr (kMaskMod) {
    const MaskModWalk walk(blocks, mod.classes);
    const int num_blocks = walk.num_blocks;
    int t_masked = walk.next_masked(0);
    int t_full = walk.next_full(walk.num_masked);
    const int first = t_masked < num_blocks ? t_masked : t_full;
    if (first >= num_blocks) return;
    copy_rows_zero_fill<true>(gmem_copy, tQgQ, tQsQ, tQcQ, args.rows_valid_q);
    load_k(cute::true_type{}, blocks.block_at(first));
    cute::cp_async_fence();
    while (t_masked < num_blocks) {
      const int t_next = walk.next_masked(t_masked + 1);
      kv_step(cute::true_type{}, blocks.block_at(t_masked),
              walk.block_or_none(t_next < num_blocks ? t_next : t_full));
      t_masked = t_next;
    }
    while (t_full < num_blocks) {
      const int t_next = walk.next_full(t_full + 1);
      kv_step(cute::false_type{}, blocks.block_at(t_full), walk.block_or_none(t_next));
      t_full = t_next;
    }
    return;
  }
  copy_rows_zero_fill<true>(gmem_copy, tQgQ, tQsQ, tQcQ, args.rows_valid_q);
  load_k(cute::true_type{}, blocks.block_at(0));
  cute::cp_async_fence();
  const int num_masked = blocks.num_masked();
  for (int t = 0; t < num_masked; ++t) {
    kv_step(cute::true_type{}, blocks.block_at(t), t + 1 < blocks.num_blocks() ? blocks.block_at(t + 1) : -1);
  }
  for (int n_block = blocks.n_unmasked_end - 1; n_block >= blocks.n_unmasked_begin; --n_block) {
    kv_step(cute::false_type{}, n_block, n_block > blocks.n_unmasked_begin ? n_block - 1 : -1);
  }
}

}  // namespace flashjax::sm80

// Mainloop of the sm80-family tangent kernel (forward-mode derivative of attention, issue 39). With the forward's
// lse L known, P = exp(s - L) is exact per block (no online rescaling), and one sweep over the key blocks gives
//   t_lse = sum_j P_j tS_j + P_sink t_sink,       t_out = sum_j (P_j tS_j) V_j + P_j tV_j  -  t_lse O
// where tS = ds/d(inputs) . tangents = scale (tq K^T + q tK^T), times tanh' = 1 - tanh^2 under softcap. This loop
// accumulates the row sums of W = P * tS and acc = W V + P tV; the kernel (tangent_kernel.cuh) adds the sink term and
// tangent_epilogue.cuh subtracts t_lse O.
//
// Per KV block n (followed by n'), the forward's pipeline with each load doubled (one K, tK, V, tV buffer each):
//   wait K, tK[n] | issue V, tV[n]  | S = Q K^T, tS = tQ K^T + Q tK^T   (one fused pass over D: smem_gemm.cuh)
//   wait V, tV[n] | issue K, tK[n'] | P, W;  acc += W V[n] + P tV[n]
// Blocks are visited in KvBlockRange order, masked blocks first in a loop with the band mask, then the bulk in a
// mask-free loop, as in fwd_mainloop.cuh, whose loaders, argument structs, score masking (mask_scores) and mask-mod
// walk (MaskModWalk) this reuses. A mask mod (kMaskMod) walks the blocks as the forward's kMaskMod twin does: the
// mod's empty tiles skipped, its partial ones masked with the bits on top of the band, its full ones mask-free.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/mask_bits.cuh"
#include "kernels/common/mask_bits_tiles.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm80/fwd_mainloop.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"
#include "kernels/sm80/smem_gemm.cuh"
#include "kernels/sm80/tangent_layouts.cuh"

namespace flashjax::sm80 {

// Elementwise step on one block, in (row, col) views of the thread's fragments: acc_s holds the masked scores (-inf
// where invisible; tanh(scale q.k / c) under softcap, raw q.k otherwise), acc_ts the raw tq.k + q.tk. Replaces acc_s
// by P = exp2(s * exp2_scale - lse_log2) and acc_ts by W = P * ds/d(q.k) * acc_ts, and adds W's row sums to w_sum.
// lse_log2 is +inf on empty and padding rows, so that P = 0 there (never NaN); masked scores give P = 0, and
// under softcap the clamp turns tanh' of a masked -inf into 0 instead of 0 * -inf = NaN.
template <bool kSoftcap, typename ScoresRC, int kRows>
__device__ __forceinline__ void tangent_probs(ScoresRC& s_rc, ScoresRC& ts_rc, const float (&lse_log2)[kRows],
                                              float exp2_scale, float softmax_scale, float (&w_sum)[kRows]) {
  using namespace cute;
  static_assert(decltype(size<0>(s_rc))::value == kRows);
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s_rc); ++ni) {
      const float s = s_rc(mi, ni);
      const float p = common::exp2_ftz(fmaf(s, exp2_scale, -lse_log2[mi]));
      // d s_true / d(q.k): scale, or scale * (1 - tanh^2) with softcap (s_true = c tanh(scale q.k / c)).
      const float ds = kSoftcap ? softmax_scale * fmaxf(1.f - s * s, 0.f) : softmax_scale;
      const float w = p * (ts_rc(mi, ni) * ds);
      s_rc(mi, ni) = p;
      ts_rc(mi, ni) = w;
      w_sum[mi] += w;
    }
  }
}

// Runs the whole KV loop of one CTA. g_q, g_tq: (kBlockM, D) tiles; g_k, g_tk, g_v, g_tv: (kBlockN, D, n_blocks).
// lse_log2: the thread's rows' forward lse in log2 units (+inf on empty and padding rows). On return acc_o holds
// W V + P tV and w_sum this thread's share of the rows' sum of W (quad-reduced by the caller); every thread is past
// its last read of Q's and tQ's buffers, and no cp.async is pending.
// kMaskMod: the call has mask bits (`mod`, ignored otherwise); the blocks are walked as fwd_mainloop_sm80's kMaskMod
// walks them. A tile with no block left to visit returns at once, having loaded nothing (acc_o and w_sum stay 0).
template <typename Layouts, bool kSoftcap, bool kMaskMod, typename GQ, typename GK, typename AccO>
__device__ __forceinline__ void tangent_mainloop_sm80(const GQ& g_q, const GQ& g_tq, const GK& g_k, const GK& g_tk,
                                                      const GK& g_v, const GK& g_tv, const FwdMainloopArgs& args,
                                                      const FwdMaskModArgs& mod, float softmax_scale,
                                                      const float (&lse_log2)[Layouts::kRowsPerThread],
                                                      typename Layouts::Element* smem, AccO& acc_o,
                                                      float (&w_sum)[Layouts::kRowsPerThread]) {
  using namespace cute;
  using Element = typename Layouts::Element;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kBlockN = Layouts::kBlockN;
  constexpr int kHeadDim = Layouts::kHeadDim;
  const int tid = threadIdx.x;

  Tensor s_q = make_tensor(make_smem_ptr(smem), typename Layouts::SmemLayoutQ{});
  Tensor s_tq = make_tensor(make_smem_ptr(smem + Layouts::kOffsetTq), typename Layouts::SmemLayoutQ{});
  Tensor s_k = make_tensor(make_smem_ptr(smem + Layouts::kOffsetK), typename Layouts::SmemLayoutKV{});
  Tensor s_tk = make_tensor(make_smem_ptr(smem + Layouts::kOffsetTk), typename Layouts::SmemLayoutKV{});
  Tensor s_v = make_tensor(make_smem_ptr(smem + Layouts::kOffsetV), typename Layouts::SmemLayoutKV{});
  Tensor s_tv = make_tensor(make_smem_ptr(smem + Layouts::kOffsetTv), typename Layouts::SmemLayoutKV{});
  Tensor s_vt = make_tensor(make_smem_ptr(smem + Layouts::kOffsetV), typename Layouts::SmemLayoutVt{});
  Tensor s_tvt = make_tensor(make_smem_ptr(smem + Layouts::kOffsetTv), typename Layouts::SmemLayoutVt{});
  Tensor s_vt_no_swizzle = make_tensor(make_smem_ptr(smem + Layouts::kOffsetV),
                                       typename Layouts::SmemLayoutVtNoSwizzle{});

  // Global -> shared.
  typename Layouts::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tKgK = gmem_thr_copy.partition_S(g_k);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKgTk = gmem_thr_copy.partition_S(g_tk);
  Tensor tVgV = gmem_thr_copy.partition_S(g_v);
  Tensor tVgTv = gmem_thr_copy.partition_S(g_tv);
  Tensor tKsK = gmem_thr_copy.partition_D(s_k);
  Tensor tKsTk = gmem_thr_copy.partition_D(s_tk);
  Tensor tVsV = gmem_thr_copy.partition_D(s_v);
  Tensor tVsTv = gmem_thr_copy.partition_D(s_tv);
  // A key tile and its tangent; only masked blocks can reach past Sk, so only they check rows (fwd_mainloop.cuh).
  auto load_pair = [&](auto check_rows, const auto& src, const auto& tsrc, auto& dst, auto& tdst, int n_block) {
    const int rows_valid = args.seqlen_k - n_block * kBlockN;
    copy_rows_zero_fill<decltype(check_rows)::value>(gmem_copy, src(_, _, _, n_block), dst, tKVcKV, rows_valid);
    copy_rows_zero_fill<decltype(check_rows)::value>(gmem_copy, tsrc(_, _, _, n_block), tdst, tKVcKV, rows_valid);
  };

  // Shared -> registers and the MMAs.
  typename Layouts::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(s_q);
  Tensor tSrTq = thr_mma.partition_fragment_A(s_tq);
  Tensor tSrK = thr_mma.partition_fragment_B(s_k);
  Tensor tSrTk = thr_mma.partition_fragment_B(s_tk);
  Tensor tOrVt = thr_mma.partition_fragment_B(s_vt_no_swizzle);  // holds V^T's, then tV^T's, k-slices
  auto smem_copy_q = make_tiled_copy_A(typename Layouts::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_copy_q.partition_S(s_q);
  Tensor tSsTq = smem_thr_copy_q.partition_S(s_tq);
  auto smem_copy_k = make_tiled_copy_B(typename Layouts::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_copy_k.partition_S(s_k);
  Tensor tSsTk = smem_thr_copy_k.partition_S(s_tk);
  auto smem_copy_v = make_tiled_copy_B(typename Layouts::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_copy_v.partition_S(s_vt);
  Tensor tOsTvt = smem_thr_copy_v.partition_S(s_tvt);

  // Tile-local (row, col) of each score this thread holds, for the band mask.
  Tensor tScS_rc =
      common::acc_rowcol_view(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));

  auto kv_step = [&](auto apply_mask, int n_block, int next_n_block) {
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_ts = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_ts);
    // K, tK[n] (and Q, tQ) have landed, and every thread is done reading the previous V, tV: refill them.
    cute::cp_async_wait<0>();
    __syncthreads();
    load_pair(apply_mask, tVgV, tVgTv, tVsV, tVsTv, n_block);
    cute::cp_async_fence();

    gemm_smem_smem_with_tangent(tiled_mma, acc_s, acc_ts, tSrQ, tSrTq, tSrK, tSrTk, tSsQ, tSsTq, tSsK, tSsTk,
                                smem_copy_q, smem_copy_k);
    Tensor acc_s_rc = mask_scores<kBlockN, kSoftcap, kMaskMod>(apply_mask, acc_s, tScS_rc, args, mod, n_block);
    Tensor acc_ts_rc = common::acc_rowcol_view(acc_ts);

    // V, tV[n] have landed, and every thread is done reading K, tK[n] (and Q, tQ): K's buffers may be refilled.
    cute::cp_async_wait<0>();
    __syncthreads();
    if (next_n_block >= 0) {
      load_pair(apply_mask, tKgK, tKgTk, tKsK, tKsTk, next_n_block);
      cute::cp_async_fence();
    }

    tangent_probs<kSoftcap>(acc_s_rc, acc_ts_rc, lse_log2, args.transform.exp2_scale, softmax_scale, w_sum);
    // W and P as A operands straight from registers (two n8 accumulator tiles form one k16 A tile).
    Tensor w = common::convert_fragment<Element>(acc_ts);
    Tensor p = common::convert_fragment<Element>(acc_s);
    Tensor tOrW = make_tensor(w.data(), common::acc_as_a_operand_layout(w.layout()));
    Tensor tOrP = make_tensor(p.data(), common::acc_as_a_operand_layout(p.layout()));
    gemm_reg_smem(tiled_mma, acc_o, tOrW, tOrVt, tOsVt, smem_copy_v);
    gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsTvt, smem_copy_v);
  };

  const common::KvBlockRange& blocks = args.blocks;
  if constexpr (kMaskMod) {
    // fwd_mainloop_sm80's walk (MaskModWalk), the (K, tK) prefetch chain linking the blocks actually visited.
    const MaskModWalk walk(blocks, mod.classes);
    const int num_blocks = walk.num_blocks;
    int t_masked = walk.next_masked(0);
    int t_full = walk.next_full(walk.num_masked);
    const int first = t_masked < num_blocks ? t_masked : t_full;
    if (first >= num_blocks) return;
    copy_rows_zero_fill<true>(gmem_copy, gmem_thr_copy.partition_S(g_q), gmem_thr_copy.partition_D(s_q), tQcQ,
                              args.rows_valid_q);
    copy_rows_zero_fill<true>(gmem_copy, gmem_thr_copy.partition_S(g_tq), gmem_thr_copy.partition_D(s_tq), tQcQ,
                              args.rows_valid_q);
    load_pair(cute::true_type{}, tKgK, tKgTk, tKsK, tKsTk, blocks.block_at(first));
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
  copy_rows_zero_fill<true>(gmem_copy, gmem_thr_copy.partition_S(g_q), gmem_thr_copy.partition_D(s_q), tQcQ,
                            args.rows_valid_q);
  copy_rows_zero_fill<true>(gmem_copy, gmem_thr_copy.partition_S(g_tq), gmem_thr_copy.partition_D(s_tq), tQcQ,
                            args.rows_valid_q);
  load_pair(cute::true_type{}, tKgK, tKgTk, tKsK, tKsTk, blocks.block_at(0));
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

// Mainloop of the sm80 backward: one CTA holds a block of kBlockN keys (K_j, V_j loaded once) and walks every
// (query head of the GQA group, M block in the band) pair, accumulating dK_j and dV_j in registers and adding each
// step's dQ contribution into the f32 workspace with atomics.
//
// Per step (Q_i, dO_i arriving through cp.async; a double-buffered tile loads the next step's during this one, a
// single-buffered dO the next once dV is done, a single-buffered Q the next after dK):
//   S = Q_i K_j^T -> softcap, mask -> P (Element, to smem) and P * tanh' (f32, registers)
//   dP = dO_i V_j^T -> dS = P * tanh' * (dP - D') (Element, to smem)
//   dV_j += P^T dO_i;  dQ_i += dS K_j (atomics);  dK_j += dS^T Q_i
// Three barriers per step (four with a single dO buffer): Q_i / dO_i landed, P / dS stored, every read of this
// step's buffers done (and, with one dO buffer, every read of dO done). Where V lives in registers (Layouts::
// kVInRegs), it is read from shared memory once, before the first step, and P / dS take its tile.
#pragma once

#include <cute/tensor.hpp>

#include "flashjax/params.h"
#include "kernels/common/bwd_band_mask.cuh"
#include "kernels/common/mask_bits.cuh"
#include "kernels/common/mask_bits_tiles.cuh"
#include "kernels/sm80/bwd_dq_accum.cuh"
#include "kernels/sm80/bwd_layouts.cuh"
#include "kernels/sm80/bwd_scores.cuh"
#include "kernels/sm80/bwd_tile_scheduler.cuh"
#include "kernels/sm80/mma_fragment_layouts.cuh"
#include "kernels/sm80/smem_gemm.cuh"

namespace flashjax::sm80 {

// Copies a (kRows x D) tile from global to shared memory with cp.async; rows >= valid_rows are zero-filled and
// their (possibly out-of-range) addresses never dereferenced.
template <typename Layouts, typename GmemTile, typename SmemTile>
__device__ __forceinline__ void load_tile_zfill(const GmemTile& gmem, SmemTile& smem, int valid_rows) {
  using namespace cute;
  typename Layouts::GmemTiledCopyLoad tiled_copy;
  auto thr_copy = tiled_copy.get_slice(threadIdx.x);
  auto src = thr_copy.partition_S(gmem);
  auto dst = thr_copy.partition_D(smem);
  auto coords = thr_copy.partition_S(make_identity_tensor(shape(gmem)));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_valid = get<0>(coords(0, m, 0)) < valid_rows;
    copy(tiled_copy.with(row_valid), src(_, m, _), dst(_, m, _));
  }
}

// A (kRows x D) tile of a [B, S, H, D] tensor, starting at row `row`.
template <int kRows, int kHeadDim, typename Element>
__device__ __forceinline__ auto gmem_tile(const void* base, int64_t batch_offset, int64_t row_stride,
                                          int64_t head_offset, int row) {
  using namespace cute;
  const Element* ptr = static_cast<const Element*>(base) + batch_offset + head_offset + row * row_stride;
  return make_tensor(make_gmem_ptr(ptr), Shape<Int<kRows>, Int<kHeadDim>>{}, make_stride(row_stride, _1{}));
}

// Runs every step of the CTA owning keys [tile.block * kBlockN, +kBlockN) of KV head tile.head in sequence tile.seq
// (rows of the tensors and of the workspace from the sequence's starts; the band from its used lengths, which mask
// holds); acc_dk / acc_dv are TiledMmaDkv fragments of (kBlockN x D), zero on entry, holding unscaled dK and dV on
// return. smem is the CTA's dynamic shared memory (Layouts::kSmemBytes). Returns with all of shared memory free.
// kSoftcap = false compiles the softcap-free step only (valid when params.softcap <= 0): with both variants as
// runtime branches, the d128 step used all 255 registers and spilled.
// kMaskMod (params.mask_bits set, the tile classes of this pass's tiles written before the kernel): steps whose
// (query head, M block) tile the mod's class says is empty are skipped, prefetches included; partial ones apply the
// bits after the band mask, full ones only the band's (bits of the step's own query head h, for every head of the
// group). A CTA with no step left loads nothing and returns zero dK / dV.
template <typename Layouts, bool kSoftcap, bool kMaskMod, typename AccDkv>
__device__ void bwd_mainloop_sm80(const BwdParams& params, const common::BwdBandMask& mask, const BwdBlock& tile,
                                  typename Layouts::Element* smem, AccDkv& acc_dk, AccDkv& acc_dv) {
  using namespace cute;
  using Element = typename Layouts::Element;
  constexpr int kBlockM = Layouts::kBlockM;
  constexpr int kBlockN = Layouts::kBlockN;
  constexpr int kHeadDim = Layouts::kHeadDim;
  constexpr int kStagesQ = Layouts::kStagesQ;
  constexpr int kStagesdO = Layouts::kStagesdO;
  const int tid = threadIdx.x;
  const int n_start = tile.block * kBlockN;
  const int kv_head = tile.head;
  const int batch = tile.seq.batch;

  const common::MBlockRange m_blocks = mask.m_blocks<kBlockM, kBlockN>(n_start);
  const int num_m_blocks = m_blocks.end - m_blocks.begin;
  const int group = params.heads_q / params.heads_k;
  if (num_m_blocks <= 0) return;
  const int num_steps = num_m_blocks * group;

  // Step -> (query head, M block): heads outer, so consecutive steps of one head walk down the band. Each CTA
  // starts at a different M block (rotated by its KV block): without a band, every CTA of a head would otherwise
  // add into the same dQ rows at the same time, and same-address atomics serialize in L2.
  const int m_rotation = tile.block % num_m_blocks;
  auto step_head = [&](int step) { return kv_head * group + step / num_m_blocks; };
  auto step_m_block = [&](int step) {
    int m = step % num_m_blocks + m_rotation;
    if (m >= num_m_blocks) m -= num_m_blocks;
    return m_blocks.begin + m;
  };
  auto step_m_start = [&](int step) { return step_m_block(step) * kBlockM; };
  // The mod's bits and classes as a dense grid (varlen: b the sequence, rows and keys local to it; mask_grid.h).
  using ModClasses = common::MaskTileClasses<kBlockM, kBlockN>;
  const AttnShape mod_grid = mask_bits_grid(params);
  auto step_class = [&](int step) {
    return ModClasses::at(mod_grid, tile.seq.mod_batch, step_head(step), step_m_block(step), tile.block);
  };
  // The first step at or after `step` that has work (every step without a mask mod).
  auto next_step = [&](int step) {
    if constexpr (kMaskMod) {
      while (step < num_steps && step_class(step) == common::kMaskTileEmpty) ++step;
    }
    return step;
  };
  const int first_step = next_step(0);
  if (first_step >= num_steps) return;

  // Shared memory tiles (layouts in bwd_layouts.cuh). Q and dO have kStagesQ / kStagesdO buffers.
  auto smem_q = [&](int stage) {
    return make_tensor(make_smem_ptr(smem + Layouts::kOffsetQ + stage * Layouts::kElemsQdO),
                       typename Layouts::SmemLayoutQdO{});
  };
  auto smem_do = [&](int stage) {
    return make_tensor(make_smem_ptr(smem + Layouts::kOffsetdO + stage * Layouts::kElemsQdO),
                       typename Layouts::SmemLayoutQdO{});
  };
  auto smem_qt = [&](int stage) {
    return make_tensor(make_smem_ptr(smem + Layouts::kOffsetQ + stage * Layouts::kElemsQdO),
                       typename Layouts::SmemLayoutQdOt{});
  };
  auto smem_dot = [&](int stage) {
    return make_tensor(make_smem_ptr(smem + Layouts::kOffsetdO + stage * Layouts::kElemsQdO),
                       typename Layouts::SmemLayoutQdOt{});
  };
  Tensor sK = make_tensor(make_smem_ptr(smem + Layouts::kOffsetK), typename Layouts::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem + Layouts::kOffsetV), typename Layouts::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem + Layouts::kOffsetK), typename Layouts::SmemLayoutKt{});
  Tensor sP = make_tensor(make_smem_ptr(smem + Layouts::kOffsetP), typename Layouts::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(smem + Layouts::kOffsetdS), typename Layouts::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(smem + Layouts::kOffsetP), typename Layouts::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem + Layouts::kOffsetdS), typename Layouts::SmemLayoutPdSt{});

  // K_j and V_j: one cp.async group, waited for together with the first Q / dO. The sequence's first row goes
  // into the batch offset (varlen; 0 dense): row indices stay sequence-local, as the band and the predicates see them.
  const int64_t k_batch = batch * params.k_batch_stride + int64_t(tile.seq.k_start) * params.k_row_stride;
  const int64_t v_batch = batch * params.v_batch_stride + int64_t(tile.seq.k_start) * params.v_row_stride;
  const int64_t k_head = kv_head * params.k_head_stride, v_head = kv_head * params.v_head_stride;
  load_tile_zfill<Layouts>(
      gmem_tile<kBlockN, kHeadDim, Element>(params.k, k_batch, params.k_row_stride, k_head, n_start), sK,
      tile.seq.seqlen_k - n_start);
  load_tile_zfill<Layouts>(
      gmem_tile<kBlockN, kHeadDim, Element>(params.v, v_batch, params.v_row_stride, v_head, n_start), sV,
      tile.seq.seqlen_k - n_start);
  cp_async_fence();

  // Q / dO tiles of a step into a stage; the caller commits the cp.async group.
  auto load_tile_of_step = [&](const void* base, int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                               int step, Element* stage_smem) {
    const int m_start = step_m_start(step);
    Tensor dst = make_tensor(make_smem_ptr(stage_smem), typename Layouts::SmemLayoutQdO{});
    load_tile_zfill<Layouts>(
        gmem_tile<kBlockM, kHeadDim, Element>(base, batch * batch_stride + int64_t(tile.seq.q_start) * row_stride,
                                              row_stride, step_head(step) * head_stride, m_start),
        dst, tile.seq.seqlen_q - m_start);
  };
  auto load_q = [&](int step, int stage) {
    load_tile_of_step(params.q, params.q_batch_stride, params.q_row_stride, params.q_head_stride, step,
                      smem + Layouts::kOffsetQ + stage * Layouts::kElemsQdO);
  };
  auto load_do = [&](int step, int stage) {
    load_tile_of_step(params.dout, params.do_batch_stride, params.do_row_stride, params.do_head_stride, step,
                      smem + Layouts::kOffsetdO + stage * Layouts::kElemsQdO);
  };
  load_q(first_step, 0);
  load_do(first_step, 0);
  cp_async_fence();

  // S = Q K^T and dP = dO V^T: shared -> registers through ldmatrix, P / dS back to shared memory.
  typename Layouts::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_slice(tid);
  Tensor rQ = thr_sdp.partition_fragment_A(smem_q(0));
  Tensor rK = thr_sdp.partition_fragment_B(sK);
  Tensor rdO = thr_sdp.partition_fragment_A(smem_do(0));
  Tensor rV = thr_sdp.partition_fragment_B(sV);
  auto copy_a_sdp = make_tiled_copy_A(typename Layouts::SmemCopyAtom{}, mma_sdp);
  auto copy_b_sdp = make_tiled_copy_B(typename Layouts::SmemCopyAtom{}, mma_sdp);
  auto thr_a_sdp = copy_a_sdp.get_slice(tid);
  auto thr_b_sdp = copy_b_sdp.get_slice(tid);
  Tensor tSsK = thr_b_sdp.partition_S(sK);
  Tensor tdPsV = thr_b_sdp.partition_S(sV);
  auto copy_pds = make_tiled_copy_C(typename Layouts::SmemCopyAtomStore{}, mma_sdp);
  auto thr_pds = copy_pds.get_slice(tid);
  Tensor tPsP = thr_pds.partition_D(sP);
  Tensor tdSsdS = thr_pds.partition_D(sdS);
  // Tile-local (row, col) of each score the thread holds, for the mask and the per-row LSE / D' reads.
  const auto score_coords =
      common::acc_rowcol_view(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  constexpr int kRowsPerThread = decltype(size<0>(score_coords))::value;

  // dV += P^T dO and dK += dS^T Q: every operand is a transposed view (ldmatrix.trans).
  typename Layouts::TiledMmaDkv mma_dkv;
  auto thr_dkv = mma_dkv.get_slice(tid);
  // Register fragments are shaped from the unswizzled views: the swizzle only permutes addresses.
  Tensor rPt = thr_dkv.partition_fragment_A(make_tensor(sPt.data(), typename Layouts::SmemLayoutPdStNoSwizzle{}));
  Tensor rdSt = thr_dkv.partition_fragment_A(make_tensor(sdSt.data(), typename Layouts::SmemLayoutPdStNoSwizzle{}));
  Tensor rdOt =
      thr_dkv.partition_fragment_B(make_tensor(smem_dot(0).data(), typename Layouts::SmemLayoutQdOtNoSwizzle{}));
  Tensor rQt =
      thr_dkv.partition_fragment_B(make_tensor(smem_qt(0).data(), typename Layouts::SmemLayoutQdOtNoSwizzle{}));
  auto copy_a_dkv = make_tiled_copy_A(typename Layouts::SmemCopyAtomTransposed{}, mma_dkv);
  auto copy_b_dkv = make_tiled_copy_B(typename Layouts::SmemCopyAtomTransposed{}, mma_dkv);
  auto thr_a_dkv = copy_a_dkv.get_slice(tid);
  auto thr_b_dkv = copy_b_dkv.get_slice(tid);
  Tensor tdVsPt = thr_a_dkv.partition_S(sPt);
  Tensor tdKsdSt = thr_a_dkv.partition_S(sdSt);

  // dQ = dS K: A = dS as stored, B = K^T (ldmatrix.trans), kDqChunks column chunks of kDqCols.
  constexpr int kDqCols = Layouts::kDqCols;
  typename Layouts::TiledMmaDq mma_dq;
  auto thr_dq = mma_dq.get_slice(tid);
  Tensor rdS = thr_dq.partition_fragment_A(sdS);
  Tensor rKt = thr_dq.partition_fragment_B(make_tensor(sKt.data(), Layout<Shape<Int<kDqCols>, Int<kBlockN>>>{}));
  auto copy_a_dq = make_tiled_copy_A(typename Layouts::SmemCopyAtom{}, mma_dq);
  auto copy_b_dq = make_tiled_copy_B(typename Layouts::SmemCopyAtomTransposed{}, mma_dq);
  auto thr_b_dq = copy_b_dq.get_slice(tid);
  Tensor tdQsdS = copy_a_dq.get_slice(tid).partition_S(sdS);
  auto tdQsKt_chunk = [&](int chunk) {
    return thr_b_dq.partition_S(local_tile(sKt, Shape<Int<kDqCols>, Int<kBlockN>>{}, make_coord(chunk, 0)));
  };

  const BwdScoreScales scales(params.softmax_scale, params.softcap);

  if constexpr (Layouts::kVInRegs) {
    // K / V (the first cp.async group) landed for every thread: V to registers, for every step. P and dS overwrite
    // its tile only after step 0's first barrier, which each thread reaches after these reads.
    cp_async_wait<1>();
    __syncthreads();
    copy(copy_b_sdp, tdPsV, thr_b_sdp.retile_D(rV));
  }

  // `visit` counts the steps run (the stage parity); without a mask mod it is `step` itself.
  for (int step = first_step, visit = 0; step < num_steps; ++visit) {
    const int next = next_step(step + 1);
    const int parity = kMaskMod ? visit % 2 : step % 2;
    const int stage_q = kStagesQ == 2 ? parity : 0;
    const int stage_do = kStagesdO == 2 ? parity : 0;
    const int head = step_head(step);
    const int m_start = step_m_start(step);
    // The other stage was last read by the previous step, which ended on a barrier. The newest cp.async group is
    // then the next step's; this step's Q and dO were committed before it (a single dO buffer's during the previous).
    if (kStagesQ == 2 && next < num_steps) {
      load_q(next, stage_q ^ 1);
      if (kStagesdO == 2) load_do(next, stage_do ^ 1);
      cp_async_fence();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }

    // Per-row LSE (log2) and D' from the workspace; padding keeps the whole M block in bounds (varlen: inside the
    // sequence's own rows of the slab, which hold lse_log2 = +inf past its used rows).
    const int64_t ws_rows =
        (int64_t(batch) * params.heads_q + head) * params.seqlen_q_rounded + tile.seq.ws_start + m_start;
    Tensor lse_log2 = make_tensor<float>(Shape<Int<kRowsPerThread>>{});
    Tensor dpsum = make_tensor<float>(Shape<Int<kRowsPerThread>>{});
    CUTE_UNROLL
    for (int mi = 0; mi < kRowsPerThread; ++mi) {
      const int row = get<0>(score_coords(mi, 0));
      lse_log2(mi) = params.lse_log2[ws_rows + row];
      dpsum(mi) = params.dpsum[ws_rows + row];
    }
    __syncthreads();

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_smem_smem(mma_sdp, acc_s, rQ, rK, thr_a_sdp.partition_S(smem_q(stage_q)), tSsK, copy_a_sdp, copy_b_sdp);
    if constexpr (kSoftcap) apply_softcap(acc_s, scales.tanh_prescale);
    if (mask.needs_mask<kBlockM, kBlockN>(m_start, n_start)) {
      auto acc_s_rc = common::acc_rowcol_view(acc_s);
      mask.apply(acc_s_rc, score_coords, m_start, n_start);
    }
    if constexpr (kMaskMod) {
      if (step_class(step) == common::kMaskTilePartial) {
        auto acc_s_rc = common::acc_rowcol_view(acc_s);
        common::MaskBitsRows::of(mod_grid, tile.seq.mod_batch, head)
            .template apply<kBlockN>(acc_s_rc, score_coords, m_start, n_start);
      }
    }
    Tensor rP = make_tensor<Element>(acc_s.layout());
    probs_from_scores<kSoftcap>(acc_s, rP, lse_log2, scales.exp2_scale);
    copy(copy_pds, thr_pds.retile_S(rP), tPsP);

    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    if constexpr (Layouts::kVInRegs) {
      gemm_smem_reg(mma_sdp, acc_dp, rdO, rV, thr_a_sdp.partition_S(smem_do(stage_do)), copy_a_sdp);
    } else {
      gemm_smem_smem(mma_sdp, acc_dp, rdO, rV, thr_a_sdp.partition_S(smem_do(stage_do)), tdPsV, copy_a_sdp,
                     copy_b_sdp);
    }
    ds_from_dp(acc_dp, acc_s, dpsum);
    Tensor rdS_store = common::convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_pds.retile_S(rdS_store), tdSsdS);
    __syncthreads();

    gemm_smem_smem(mma_dkv, acc_dv, rPt, rdOt, tdVsPt, thr_b_dkv.partition_S(smem_dot(stage_do)), copy_a_dkv,
                   copy_b_dkv);
    // Single-buffered: dO is free once every warp is past dV; its next tile loads behind dQ and dK.
    if (kStagesdO == 1 && next < num_steps) {
      __syncthreads();
      load_do(next, 0);
      cp_async_fence();
    }

    // The dQ atomics are issued before dK's MMAs so that their latency hides behind them.
    CUTE_UNROLL
    for (int chunk = 0; chunk < Layouts::kDqChunks; ++chunk) {
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kDqCols>>{});
      clear(acc_dq);
      gemm_smem_smem(mma_dq, acc_dq, rdS, rKt, tdQsdS, tdQsKt_chunk(chunk), copy_a_dq, copy_b_dq);
      atomic_add_dq_chunk<Layouts>(
          params.dq_accum + dq_accum_chunk_start<Layouts>(params, batch, head, tile.seq.ws_start + m_start, chunk),
          acc_dq);
    }

    gemm_smem_smem(mma_dkv, acc_dk, rdSt, rQt, tdKsdSt, thr_b_dkv.partition_S(smem_qt(stage_q)), copy_a_dkv,
                   copy_b_dkv);
    __syncthreads();
    if (kStagesQ == 1 && next < num_steps) {
      load_q(next, 0);
      cp_async_fence();
    }
    step = next;
  }
}

}  // namespace flashjax::sm80

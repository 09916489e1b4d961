// The sm90 fused jvp kernel (jax.jvp of attention, issue 39): out, lse and their tangents in one pass, S computed
// once (jvp_mainloop.cuh). The tangent kernel's CTA (tangent_kernel.cuh) with the forward's online softmax in its
// consumers: one CTA per (batch, query head, 128-row block), the last block of a head first; a producer warpgroup
// (warp 0: Q, tQ and the (K, tK) stages; warp 1: the (V, tV) stages) and two consumer warpgroups of 64 rows. Dense
// calls at D <= 128 only (jvp_tile_sizes.cuh): varlen, mask mods and wider heads keep the forward + tangent pair.
// Softcap is a compile-time twin, for the forward's reason (fwd_mainloop.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/jvp_epilogue.cuh"
#include "kernels/sm90/jvp_mainloop.cuh"
#include "kernels/sm90/jvp_tile_sizes.cuh"
#include "kernels/sm90/tangent_kernel.cuh"

namespace flashjax::sm90 {

// The tangent kernel's CTA (TangentCtaSm90) around the jvp's mainloop and epilogue.
template <typename Element, int kHeadDim, bool kSoftcap>
struct JvpKernelSm90
    : TangentCtaSm90<JvpMainloopSm90<Element, kHeadDim, jvp_tile_sizes(kHeadDim).block_n,
                                     jvp_tile_sizes(kHeadDim).stages_k, jvp_tile_sizes(kHeadDim).stages_v, kSoftcap>,
                     JvpEpilogueSm90> {
  static_assert(kHeadDim <= kJvpMaxHeadDim, "O and its tangent do not fit the registers past D 128");
  static_assert(JvpKernelSm90::kBlockM == jvp_tile_sizes(kHeadDim).block_m);
  using Params = typename JvpKernelSm90::DenseParams;
};

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) jvp_kernel_sm90(const __grid_constant__ typename Kernel::Params params) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using Mainloop = typename Kernel::Mainloop;
  using Epilogue = typename Kernel::Epilogue;
  using PipelineK = typename Mainloop::PipelineK;
  using PipelineV = typename Mainloop::PipelineV;
  constexpr int kBlockM = Kernel::kBlockM;
  constexpr int kBlockN = Kernel::kBlockN;

  extern __shared__ char smem_bytes[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_bytes);
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool is_producer = warpgroup == 0;

  if (threadIdx.x == 0) shared.barriers.q.init(/*arrive_count=*/1);  // the producer's expect_tx
  // The pipelines are the tangent's: a stage is two tiles on one full barrier (tangent_pipeline_params).
  PipelineK pipeline_k(shared.barriers.k, tangent_pipeline_params<PipelineK, Kernel>(is_producer, 0),
                       Shape<_1, _1, _1>{});
  PipelineV pipeline_v(shared.barriers.v, tangent_pipeline_params<PipelineV, Kernel>(is_producer, 32),
                       Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  const auto tile = Kernel::Scheduler::tile(params.shape, blockIdx.x);
  const int head_k = tile.head_q / params.heads_per_kv;
  const common::BandMask band(params.shape.seqlen_q, params.shape.seqlen_k, params.shape.window_left,
                              params.shape.window_right);
  const common::KvBlockRange blocks = band.template kv_blocks<kBlockM, kBlockN>(tile.m_block * kBlockM);

  if (is_producer) {  // an empty tile's consumers write out = 0 and the empty rows' lse
    tangent_producer<Kernel>(params, shared, pipeline_k, pipeline_v, tile, head_k, blocks);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegisters>();
  const int consumer_wg = warpgroup - 1;
  const int thread_in_wg = threadIdx.x % 128;
  const common::ScoreTransform transform(params.shape.softmax_scale, params.shape.softcap);
  JvpRowStats stats(transform.exp2_scale);
  typename Mainloop::TiledMmaPV mma_pv;
  Tensor acc_o = partition_fragment_C(mma_pv, Shape<typename Mainloop::WgRows, typename Mainloop::HeadDim>{});
  Tensor acc_t = partition_fragment_C(mma_pv, Shape<typename Mainloop::WgRows, typename Mainloop::HeadDim>{});
  clear(acc_o);
  clear(acc_t);
  if (!blocks.empty()) {
    const common::TileMask mask = band.tile_mask(tile.m_block * kBlockM + consumer_wg * Mainloop::kRowsPerWarpgroup);
    Mainloop::run(shared.tensors, shared.barriers, pipeline_k, pipeline_v, blocks, mask, consumer_wg, thread_in_wg,
                  transform, params.shape.softmax_scale, stats, acc_o, acc_t);
  }
  Epilogue::store(params.epilogue, acc_o, acc_t, stats, shared.tensors.q.data() + consumer_wg * Mainloop::kQHalfElems,
                  shared.tensors.tq.data() + consumer_wg * Mainloop::kQHalfElems, consumer_wg, thread_in_wg,
                  tile.m_block, tile.head_q, tile.batch);
#endif
}

}  // namespace flashjax::sm90

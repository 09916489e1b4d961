// The sm90 forward kernel: wires tile scheduler, mainloop, softmax finalization and epilogue with warp
// specialization. One instantiation per (Element, head dim) covers every feature: softcap, causal/local band,
// GQA, sinks and ragged sizes are runtime decisions, per CTA tile or per KV block.
//
// CTA = 3 warpgroups, one CTA per SM, persistent over tiles:
//   warpgroup 0, producer: gives registers back (setmaxnreg.dec to 24); one warp issues every TMA load, the other
//     three exit;
//   warpgroups 1 and 2, consumers: take the registers (setmaxnreg.inc to 240; 128 * 24 + 256 * 240 = 64512 =
//     384 * 168, the per-thread cap __launch_bounds__(384, 1) compiles for), 64 query rows each, taking turns on
//     the tensor cores (ping-pong named barriers) so that one warpgroup's softmax overlaps the other's GEMMs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/sm90_wgmma.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/fwd_epilogue.cuh"
#include "kernels/sm90/fwd_mainloop.cuh"
#include "kernels/sm90/fwd_named_barriers.cuh"
#include "kernels/sm90/fwd_softmax.cuh"
#include "kernels/sm90/fwd_tile_scheduler.cuh"
#include "kernels/sm90/fwd_tile_sizes.cuh"

namespace flashjax::sm90 {

// kBlockN comes from fwd_tile_sizes (the launcher picks between its banded and unbanded answers).
template <typename Element, int kHeadDim, int kBlockN>
struct FwdKernelSm90 {
  // Two K and two V stages: the load of block j - 1 overlaps the GEMMs of block j; FA3 measured more stages as
  // no faster, and at D = 256 they would not fit.
  using Mainloop = FwdMainloopSm90<Element, kHeadDim, kBlockN, 2>;
  using Epilogue = FwdEpilogueSm90<Mainloop>;
  using Scheduler = FwdTileSchedulerSm90<Mainloop::kBlockM, Mainloop::kBlockN>;
  static_assert(fwd_tile_sizes(kHeadDim, true).block_m == Mainloop::kBlockM &&
                    fwd_tile_sizes(kHeadDim, false).block_m == Mainloop::kBlockM,
                "the M tile is two 64-row consumer warpgroups");

  static constexpr int kConsumerThreads = Mainloop::kConsumerWarpgroups * 128;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    typename Mainloop::BarrierStorage barriers;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "over the sm90 per-block shared memory limit");

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
    int seqlen_q, seqlen_k;
    int window_left, window_right;
    float softmax_scale, softcap;
    int heads_per_kv;    // Hq / Hk: query head h reads K/V head h / heads_per_kv
    const float* sinks;  // [Hq] or nullptr
  };
};

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    fwd_kernel_sm90(const __grid_constant__ typename Kernel::Params params) {
  // wgmma and setmaxnreg exist only on sm_90a: any other device pass compiles an empty kernel, which the
  // dispatcher never launches.
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using Mainloop = typename Kernel::Mainloop;
  using Epilogue = typename Kernel::Epilogue;
  using Scheduler = typename Kernel::Scheduler;
  using PipelineKV = typename Mainloop::PipelineKV;
  using PipelineState = typename Mainloop::PipelineState;
  constexpr int kBlockM = Mainloop::kBlockM;
  constexpr int kBlockN = Mainloop::kBlockN;

  extern __shared__ char smem_bytes[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_bytes);
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool is_producer = warpgroup == 0;

  if (threadIdx.x == 0) shared.barriers.q.init(/*arrive_count=*/1);  // the producer's arrive_and_expect_tx
  typename PipelineKV::Params pipeline_params;
  pipeline_params.transaction_bytes = Mainloop::kTmaBytesKV;
  pipeline_params.role = is_producer ? PipelineKV::ThreadCategory::Producer : PipelineKV::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  // Every consumer thread releases a stage after its own wgmma wait, so none relies on its warpgroup being in step.
  pipeline_params.num_consumers = Kernel::kConsumerThreads;
  PipelineKV pipeline_k(shared.barriers.k, pipeline_params, Shape<_1, _1, _1>{});
  PipelineKV pipeline_v(shared.barriers.v, pipeline_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();  // barrier initialization visible to every thread (and to TMA) before first use

  const common::BandMask band(params.seqlen_q, params.seqlen_k, params.window_left, params.window_right);

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
    if (cutlass::canonical_warp_idx_sync() != 0) return;
    const bool leader = threadIdx.x == 0;
    if (leader) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Epilogue::prefetch_tma_descriptors(params.epilogue);
    }
    PipelineState write = cutlass::make_producer_start_state<PipelineKV>();
    for (int tile_index = Scheduler::first_tile(); tile_index < params.scheduler.num_tiles;
         tile_index = Scheduler::next_tile(tile_index)) {
      const auto tile = Scheduler::tile(params.scheduler, tile_index);
      Mainloop::load(params.mainloop, shared.tensors, shared.barriers, pipeline_k, pipeline_v, write, leader,
                     tile.m_block, tile.head_q, tile.head_q / params.heads_per_kv, tile.batch,
                     band.template kv_blocks<kBlockM, kBlockN>(tile.m_block * kBlockM));
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegisters>();
  const int consumer_wg = warpgroup - 1;
  const int thread_in_wg = threadIdx.x % 128;
  const common::ScoreTransform transform(params.softmax_scale, params.softcap);
  PipelineState read_k, read_v;
  uint32_t q_phase = 0;  // flips once per tile with work: the only tiles that load Q
  // The Q buffer starts free; warpgroup 0 takes the first turn on the tensor cores.
  cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarp + Kernel::kConsumerThreads,
                                      FwdNamedBarrier::kQueryEmpty);
  if (consumer_wg == 0) cutlass::arch::NamedBarrier::arrive(2 * 128, FwdNamedBarrier::ping_pong(0));

  for (int tile_index = Scheduler::first_tile(); tile_index < params.scheduler.num_tiles;
       tile_index = Scheduler::next_tile(tile_index)) {
    const auto tile = Scheduler::tile(params.scheduler, tile_index);
    const int m_start = tile.m_block * kBlockM;
    // The block range is the CTA's (both warpgroups consume the same K/V stages); the mask is the warpgroup's.
    const common::KvBlockRange blocks = band.template kv_blocks<kBlockM, kBlockN>(m_start);

    typename Mainloop::TiledMmaPV mma_pv;
    Tensor acc_o = partition_fragment_C(mma_pv, Shape<typename Mainloop::WgRows, typename Mainloop::HeadDim>{});
    FwdOnlineSoftmaxSm90<2> softmax(transform.exp2_scale);
    if (!blocks.empty()) {
      Mainloop::mma(shared.tensors, shared.barriers, pipeline_k, pipeline_v, read_k, read_v, q_phase, consumer_wg,
                    thread_in_wg, blocks, band.tile_mask(m_start + consumer_wg * Mainloop::kRowsPerWarpgroup),
                    transform, acc_o, softmax);
      q_phase ^= 1;
    } else {
      clear(acc_o);  // every row of the tile is empty: out = 0, lse = -inf (or the sink)
    }

    const float sink_log2 = params.sinks != nullptr ? params.sinks[tile.head_q] * common::kLog2e : -INFINITY;
    float lse[2];
    Tensor acc_o_rc = common::wgmma_acc_rowcol_view(acc_o);
    softmax.finalize(acc_o_rc, sink_log2, lse);
    Epilogue::store(params.epilogue, shared.tensors, acc_o, lse, consumer_wg, thread_in_wg, tile.m_block,
                    tile.head_q, tile.batch);
    cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarp + Kernel::kConsumerThreads,
                                        FwdNamedBarrier::kQueryEmpty);
  }
#endif
}

}  // namespace flashjax::sm90

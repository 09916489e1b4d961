// The sm90 backward main kernel: one CTA per (KV block, KV head, batch), warp specialized like the forward.
//   warpgroup 0, producer (setmaxnreg.dec): warp 0's first lane issues the TMA loads (Mainloop::load), warp 1 is the
//     dQ writer (Mainloop::store_dq; in deterministic mode it takes turns with the other CTAs, bwd_dq_order.cuh),
//     warps 2 and 3 exit;
//   warpgroups 1 and 2, MMA (setmaxnreg.inc): the steps (Mainloop::mma), dK and dV in registers throughout, then
//     the epilogue (bwd_epilogue.cuh).
//     (Each owns 64 keys over all of D, or, at D > 128, all 64 keys over half of D: bwd_tile_sizes.cuh.)
// A CTA whose keys no query row sees runs no step and writes zero dK and dV.
// Packed sequences (kVarlen, a compile-time variant: the dense kernels' code is what it was): grid (virtual key
// block, KV head, 1); a CTA finds its sequence and key block (bwd_varlen_scheduler.cuh), one with no keys there
// exits at once (the launcher zeroed dK / dV), the others run as above on the sequence's used rows and keys.
// A mask mod (kMaskMod, likewise a compile-time variant; dense only): the CTA's steps are, per query head, the query
// blocks of its list (common/mask_query_block_lists.cuh, built by the launcher before this kernel), the mod's empty
// tiles left out; a CTA whose lists are all empty runs no step and writes zero dK and dV, as one outside the band.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flashjax/params.h"
#include "kernels/common/bwd_band_mask.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/bwd_epilogue.cuh"
#include "kernels/sm90/bwd_mainloop.cuh"
#include "kernels/sm90/bwd_varlen_scheduler.cuh"

namespace flashjax::sm90 {

// Tiles and warpgroup split: bwd_tile_sizes(kHeadDim), read by the mainloop.
template <typename Element, int kHeadDim, bool kSoftcap, bool kVarlen_ = false, bool kMaskMod_ = false>
struct BwdKernelSm90 {
  using Mainloop = BwdMainloopSm90<Element, kHeadDim, kSoftcap, kVarlen_, kMaskMod_>;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr bool kMaskMod = kMaskMod_;
  using VarlenScheduler = BwdVarlenSchedulerSm90<Mainloop::kBlockN, /*kKeys=*/true>;
  static constexpr int kThreads = 128 + Mainloop::kMmaThreads;
  // 128 * 24 + 256 * 240 = 64512 of the 64K registers (see FwdKernelSm90 for the bound).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = 240;
  static_assert(128 * kProducerRegisters + Mainloop::kMmaThreads * kMmaRegisters <=
                    65536 / kThreads / 8 * 8 * kThreads,
                "setmaxnreg split over the registers the launch allocates");
  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    typename Mainloop::BarrierStorage barriers;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "over the sm90 per-block shared memory limit");

  struct Params {
    typename Mainloop::Params mainloop;
    BwdParams call;
  };
};

template <typename Pipeline, typename Mainloop>
__device__ typename Pipeline::Params bwd_pipeline_params(bool is_producer) {
  typename Pipeline::Params params;
  params.transaction_bytes = Mainloop::kTmaBytesQdO;
  params.role = is_producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;  // the thread that issues the loads
  params.num_consumers = Mainloop::kMmaThreads;
  return params;
}

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    bwd_kernel_sm90(const __grid_constant__ typename Kernel::Params params) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using Mainloop = typename Kernel::Mainloop;
  using PipelineQ = typename Mainloop::PipelineQ;
  using PipelineDo = typename Mainloop::PipelineDo;
  extern __shared__ char smem_bytes[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_bytes);
  const BwdParams& call = params.call;
  BwdVarlenBlock seq{};  // varlen: the CTA's sequence and key block
  if constexpr (Kernel::kVarlen) {
    seq = Kernel::VarlenScheduler::block(call, blockIdx.x);
    if (!Kernel::VarlenScheduler::has_work(seq)) return;  // the whole CTA, before any barrier
  }
  const BwdDqOrder order = BwdDqOrder::of(params.mainloop.dq_semaphore, call.window_right);
  const int n_block = Kernel::kVarlen ? seq.block : order.n_block(blockIdx.x, gridDim.x);
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const bool is_producer = cutlass::canonical_warp_group_idx() == 0;

  if (threadIdx.x == 0) shared.barriers.kv.init(/*arrive_count=*/1);
  PipelineQ pipeline_q(shared.barriers.q, bwd_pipeline_params<PipelineQ, Mainloop>(is_producer), Shape<_1, _1, _1>{});
  PipelineDo pipeline_do(shared.barriers.dout, bwd_pipeline_params<PipelineDo, Mainloop>(is_producer),
                         Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  const common::BwdBandMask mask(Kernel::kVarlen ? seq.seqlen_q : call.seqlen_q,
                                 Kernel::kVarlen ? seq.seqlen_k : call.seqlen_k, call.window_left, call.window_right);
  const common::MBlockRange m_blocks = mask.m_blocks<Mainloop::kBlockM, Mainloop::kBlockN>(n_block * Mainloop::kBlockN);
  const int group = call.heads_q / call.heads_k;
  const typename Mainloop::Steps steps =
      Mainloop::make_steps(kv_head * group, group, m_blocks, seq, call, batch, n_block);

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
    const int warp = cutlass::canonical_warp_idx_sync();
    if (steps.num_steps() > 0) {
      if (warp == 0 && threadIdx.x == 0) {
        Mainloop::prefetch_tma_descriptors(params.mainloop);
        Mainloop::load(params.mainloop, shared.tensors, shared.barriers, pipeline_q, pipeline_do, n_block, kv_head,
                       batch, steps);
      } else if (warp == 1) {
        Mainloop::store_dq(params.mainloop, shared.tensors, batch, steps, mask, order, n_block, gridDim.x, call);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Kernel::kMmaRegisters>();
  const int thread_idx = threadIdx.x - 128;
  typename Mainloop::TiledMmaDkv mma_dkv;
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<Mainloop::kBlockN>, Int<Mainloop::kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<Mainloop::kBlockN>, Int<Mainloop::kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  if (steps.num_steps() > 0) {
    const common::ScoreTransform transform(call.softmax_scale, call.softcap);
    Mainloop::mma(params.mainloop, shared.tensors, shared.barriers, pipeline_q, pipeline_do, mask, transform, n_block,
                  steps, thread_idx, acc_dk, acc_dv);
  }
  if constexpr (Kernel::kVarlen) {
    bwd_store_dkdv_varlen_sm90<Mainloop>(call, seq, kv_head, thread_idx, acc_dk, acc_dv);
  } else {
    bwd_store_dkdv_sm90<Mainloop>(call, n_block, kv_head, batch, thread_idx, acc_dk, acc_dv);
  }
#endif
}

}  // namespace flashjax::sm90

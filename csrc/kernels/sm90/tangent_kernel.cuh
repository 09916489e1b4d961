// The sm90 tangent kernel (jax.jvp of attention, issue 39): TMA + wgmma + warp specialization, wiring the sm80
// tangent's tile scheduler (one CTA per (batch, query head, 128-row block), the last block of a head first, so the
// causal band's longest tiles start first), the forward's band (kernels/common/band_mask.cuh), the tangent mainloop
// (tangent_mainloop.cuh) and epilogue (tangent_epilogue.cuh).
//
// CTA = 3 warpgroups:
//   warpgroup 0, producer: gives registers back (setmaxnreg.dec); warp 0 issues the TMA loads of Q, tQ and the
//     (K, tK) stages, warp 1 those of the (V, tV) stages, the other two exit;
//   warpgroups 1 and 2, consumers: take the registers (setmaxnreg.inc, 240 each as the forward's), 64 query rows each.
// Not persistent: with one tile per CTA, Q and tQ load once and no buffer changes hands between tiles (a persistent
// walk with the forward's Q hand-off is a later step). Dense calls only: varlen tangents stay on the sm80 family
// (gen_kernels.py's VARLEN). GQA reads K / V and their tangents in place through the head mapping (no packing).
// Softcap is a compile-time twin, for the forward's reason (fwd_mainloop.cuh). So is a mask mod (kMaskMod: each tile
// walks its block list and its masked steps AND the mod's bits with the band, tangent_mask_mod.cuh), so that the
// dense kernel keeps its code. A row that sees no key at all has the forward's lse = -inf (or the sink's), so P = 0 on
// every key: t_out = 0 and t_lse = P_sink t_sink, as for rows the band leaves empty.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/mask_block_lists.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm80/fwd_tile_scheduler.cuh"
#include "kernels/sm90/tangent_epilogue.cuh"
#include "kernels/sm90/tangent_mainloop.cuh"
#include "kernels/sm90/tangent_mask_mod.cuh"
#include "kernels/sm90/tangent_tile_sizes.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

// What the tangent kernel and the fused jvp kernel (jvp_kernel.cuh) share around their mainloop (TangentMainloopSm90
// or the jvp's, derived from it) and epilogue: the CTA's warpgroups and register split, the tile walk, the shared
// storage and the dense parameters.
template <typename Mainloop_, template <typename> class EpilogueT>
struct TangentCtaSm90 {
  using Mainloop = Mainloop_;
  using Epilogue = EpilogueT<Mainloop>;
  static constexpr int kBlockM = Mainloop::kBlockM;
  static constexpr int kBlockN = Mainloop::kBlockN;
  // The dense tile walk of the sm80 tangent (its forward's scheduler): CTA -> (batch, query head, m-block).
  using Scheduler = sm80::FwdTileScheduler<kBlockM>;

  static constexpr int kConsumerThreads = Mainloop::kConsumerWarpgroups * 128;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  // setmaxnreg moves registers within the pool the launch allocated (fwd_kernel.cuh).
  static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536 / kThreads / 8 * 8 * kThreads,
                "setmaxnreg split over the registers the launch allocates");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    typename Mainloop::BarrierStorage barriers;
  };
  static constexpr int kSmemLimitBytes = 227 * 1024;  // sm90 per-block opt-in maximum
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemLimitBytes, "over the sm90 per-block shared memory limit");

  struct DenseParams {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    AttnShape shape;  // the scheduler's walk and the band
    int heads_per_kv;  // Hq / Hk: query head h reads K/V head h / heads_per_kv
  };
};

template <typename Element, int kHeadDim, bool kSoftcap, bool kMaskMod_ = false>
struct TangentKernelSm90
    : TangentCtaSm90<TangentMainloopSm90<Element, kHeadDim, tangent_tile_sizes(kHeadDim).block_n,
                                         tangent_tile_sizes(kHeadDim).stages_k, tangent_tile_sizes(kHeadDim).stages_v,
                                         kSoftcap>,
                     TangentEpilogueSm90> {
  using Cta = typename TangentKernelSm90::TangentCtaSm90;
  using typename Cta::DenseParams;
  using Cta::kBlockM;
  using Cta::kBlockN;
  static_assert(kBlockM == tangent_tile_sizes(kHeadDim).block_m);
  static constexpr bool kMaskMod = kMaskMod_;

  // kMaskMod: the call's mask bits and block lists (kernels/common/mask_block_lists.cuh) after the dense fields. A
  // separate type, so that the dense kernel's parameters keep their layout.
  struct MaskModParams : DenseParams {
    common::MaskModTiles mask;
  };
  using Params = std::conditional_t<kMaskMod, MaskModParams, DenseParams>;

  // The KV blocks tile (m_block of batch, head_q) visits: the band's range, or the mask mod's list for the tile.
  using Blocks = std::conditional_t<kMaskMod, common::ListedKvBlocks, common::KvBlockRange>;
  __device__ __forceinline__ static Blocks blocks_of(const Params& params, const common::BandMask& band, int batch,
                                                     int head_q, int m_block) {
    if constexpr (kMaskMod) {
      return params.mask.blocks(batch, head_q, m_block);
    } else {
      return band.template kv_blocks<kBlockM, kBlockN>(m_block * kBlockM);
    }
  }

  // The masked steps' mask of the consumer warpgroup whose first row is m_start: the band's, and a mask mod's bits.
  using Mask = std::conditional_t<kMaskMod, TangentBandAndBitsMask<kBlockN>, common::TileMask>;
  __device__ __forceinline__ static Mask mask_of(const Params& params, const common::BandMask& band, int batch,
                                                 int head_q, int m_start) {
    if constexpr (kMaskMod) {
      return Mask::of(band.tile_mask(m_start), params.mask.bits_rows(batch, head_q), m_start);
    } else {
      return band.tile_mask(m_start);
    }
  }
};

// Parameters of the (K, tK) and (V, tV) pipelines: a stage is two tiles, both on its full barrier; the thread that
// issues a pipeline's loads (its warp's lane 0) arms it.
template <typename Pipeline, typename Kernel>
__device__ typename Pipeline::Params tangent_pipeline_params(bool is_producer, int leader_thread) {
  typename Pipeline::Params params;
  params.transaction_bytes = 2 * Kernel::Mainloop::kTmaBytesKV;
  params.role = is_producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == leader_thread;
  params.num_consumers = Kernel::kConsumerThreads;  // every consumer thread releases after its own wgmma wait
  return params;
}

// The producer warpgroup of either kernel, from its setmaxnreg on: warp 0 loads Q, tQ and the (K, tK) stages, warp 1
// the (V, tV) stages, the other two exit. A tile none of whose rows sees a key loads nothing: its consumers write
// what an empty row gets without reading shared memory. Plain __device__, which the compiler inlines all the same:
// __forceinline__ changed the code of the D 64 tangent's (K, tK) loop against the kernel body it came from.
template <typename Kernel, typename Tile, typename Blocks>
__device__ void tangent_producer(const typename Kernel::Params& params, typename Kernel::SharedStorage& shared,
                                 typename Kernel::Mainloop::PipelineK& pipeline_k,
                                 typename Kernel::Mainloop::PipelineV& pipeline_v, const Tile& tile, int head_k,
                                 const Blocks& blocks) {
  using Mainloop = typename Kernel::Mainloop;
  cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
  const int producer_warp = cutlass::canonical_warp_idx_sync();
  if (producer_warp > 1 || blocks.empty()) return;
  const bool leader = threadIdx.x % 32 == 0;
  const typename Mainloop::LoadCoords at{tile.m_block, tile.head_q, head_k, tile.batch};
  if (producer_warp == 0) {
    if (leader) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Kernel::Epilogue::prefetch_tma_descriptors(params.epilogue);
    }
    Mainloop::load_q_k(params.mainloop, shared.tensors, shared.barriers, pipeline_k, leader, at, blocks);
  } else {
    Mainloop::load_v(params.mainloop, shared.tensors, pipeline_v, leader, at, blocks);
  }
}

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    tangent_kernel_sm90(const __grid_constant__ typename Kernel::Params params) {
  // wgmma and setmaxnreg exist only on sm_90a: any other device pass compiles an empty kernel, never launched.
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using Mainloop = typename Kernel::Mainloop;
  using Epilogue = typename Kernel::Epilogue;
  using PipelineK = typename Mainloop::PipelineK;
  using PipelineV = typename Mainloop::PipelineV;
  constexpr int kBlockM = Kernel::kBlockM;

  extern __shared__ char smem_bytes[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_bytes);
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool is_producer = warpgroup == 0;

  if (threadIdx.x == 0) {
    shared.barriers.q.init(/*arrive_count=*/1);  // the producer's expect_tx
    for (auto& barrier_o : shared.barriers.o) barrier_o.init(/*arrive_count=*/1);  // each warpgroup's thread 0
  }
  PipelineK pipeline_k(shared.barriers.k, tangent_pipeline_params<PipelineK, Kernel>(is_producer, 0),
                       Shape<_1, _1, _1>{});
  PipelineV pipeline_v(shared.barriers.v, tangent_pipeline_params<PipelineV, Kernel>(is_producer, 32),
                       Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();  // barrier initialization visible to every thread (and to TMA) before first use

  const auto tile = Kernel::Scheduler::tile(params.shape, blockIdx.x);
  const int head_k = tile.head_q / params.heads_per_kv;
  const common::BandMask band(params.shape.seqlen_q, params.shape.seqlen_k, params.shape.window_left,
                              params.shape.window_right);
  const typename Kernel::Blocks blocks = Kernel::blocks_of(params, band, tile.batch, tile.head_q, tile.m_block);

  if (is_producer) {  // an empty tile's consumers write t_out = 0 and the sink's t_lse
    tangent_producer<Kernel>(params, shared, pipeline_k, pipeline_v, tile, head_k, blocks);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegisters>();
  const int consumer_wg = warpgroup - 1;
  const int thread_in_wg = threadIdx.x % 128;
  int rows[2];
  Mainloop::thread_rows(thread_in_wg, rows);
  float lse_log2[2];
  Epilogue::lse_log2_of_rows(params.epilogue, rows, tile.m_block, consumer_wg, tile.head_q, tile.batch, lse_log2);

  typename Mainloop::TiledMmaPV mma_pv;
  Tensor acc = partition_fragment_C(mma_pv, Shape<typename Mainloop::WgRows, typename Mainloop::HeadDim>{});
  clear(acc);
  float w_sum[2] = {0.f, 0.f};
  if (!blocks.empty()) {
    const common::ScoreTransform transform(params.shape.softmax_scale, params.shape.softcap);
    const int m_start = tile.m_block * kBlockM + consumer_wg * Mainloop::kRowsPerWarpgroup;
    const typename Kernel::Mask mask = Kernel::mask_of(params, band, tile.batch, tile.head_q, m_start);
    Mainloop::run(shared.tensors, shared.barriers, pipeline_k, pipeline_v, blocks, mask, consumer_wg, thread_in_wg,
                  transform, params.shape.softmax_scale, lse_log2, acc, w_sum);
  }
  Epilogue::store(params.epilogue, acc, w_sum, lse_log2,
                  shared.tensors.q.data() + consumer_wg * Mainloop::kQHalfElems, shared.barriers.o[consumer_wg],
                  consumer_wg, thread_in_wg, tile.m_block, tile.head_q, tile.batch);
#endif
}

}  // namespace flashjax::sm90

// The sm90 forward kernel: wires tile scheduler, mainloop, softmax finalization and epilogue with warp
// specialization. One instantiation per (Element, head dim) covers every feature: softcap, causal/local band,
// GQA (packed into shared tiles or not: fwd_query_tiling.cuh), sinks and ragged sizes are runtime decisions, per
// call, per CTA tile or per KV block.
//
// CTA = 3 or 4 warpgroups, one CTA per SM, persistent over tiles:
//   warpgroup 0, producer: gives registers back (setmaxnreg.dec); warp 0 issues the TMA loads of Q and K, warp 1
//     those of V, the other two exit;
//   warpgroups 1.., consumers: take the registers (setmaxnreg.inc; see kConsumerRegisters), 64 query rows each,
//     taking turns on the tensor cores (ping-pong named barriers) so that one warpgroup's softmax overlaps the
//     others' GEMMs. A consumer carries its registers from one tile into the next: where Q has two buffers, the
//     next tile's first GEMM goes out in the same turn as this tile's last (Mainloop::tail_and_prefetch), so the
//     epilogue and the next tile's first softmax no longer leave the tensor cores idle between tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <type_traits>

#include "flashjax/params.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/softcap.cuh"
#include "kernels/sm90/fwd_epilogue.cuh"
#include "kernels/sm90/fwd_mainloop.cuh"
#include "kernels/sm90/fwd_named_barriers.cuh"
#include "kernels/sm90/fwd_probe.cuh"
#include "kernels/sm90/fwd_softmax.cuh"
#include "kernels/sm90/fwd_split_epilogue.cuh"
#include "kernels/sm90/fwd_tile_scheduler.cuh"
#include "kernels/sm90/fwd_tile_sizes.cuh"
#include "kernels/sm90/fwd_varlen_epilogue.cuh"
#include "kernels/sm90/fwd_varlen_scheduler.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace flashjax::sm90 {

// Shared memory of one kernel configuration: the mainloop's tensors, O's own staging buffer where there is room,
// the barriers.
template <typename Mainloop, bool kOwnOBuffer>
struct FwdSharedStorageSm90 {
  typename Mainloop::TensorStorage tensors;
  typename Mainloop::OStagingStorage staging;
  typename Mainloop::BarrierStorage barriers;
};
template <typename Mainloop>
struct FwdSharedStorageSm90<Mainloop, false> {
  typename Mainloop::TensorStorage tensors;
  typename Mainloop::BarrierStorage barriers;
};

// How a kernel configuration spends the shared memory left after its tiles' first buffers (see FwdKernelSm90).
struct FwdBufferPlan {
  int q_stages;  // 2: the next tile's Q loads while this tile computes; 1: once this tile's last Q K^T is done
  int k_stages;  // K ring depth (V always has 2)
  bool own_o;    // O staged in a buffer of its own; else in the tile's Q buffer, freed only after the O store
};

// kBlockM and kBlockN come from fwd_tile_sizes (the launcher picks between its answers); kPackGqa: tiles hold the
// query heads of a KV head (fwd_query_tiling.cuh; the launcher picks by fwd_pack_gqa.h); kSoftcap: compiled for
// soft-capped calls (the launcher picks by the call's softcap); kSplitKv: each tile runs one part of a query tile's
// KV range and writes partial results to the workspace (fwd_split_kv.h, fwd_split_epilogue.cuh); kVarlen_: packed
// sequences, each tile one block of one sequence (fwd_varlen_scheduler.cuh, fwd_varlen_epilogue.cuh; the launcher
// picks by the call's cu_seqlens); kMaskMod_: a mask mod's bits, each tile walking its block list
// (kernels/common/mask_block_lists.cuh; the launcher picks by the call's mask_bits). Each flag is a compile-time
// variant whose branches are `if constexpr`, so that the kernels without it keep their code.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, bool kSoftcap, bool kPackGqa,
          bool kSplitKv = false, bool kVarlen_ = false, bool kMaskMod_ = false>
struct FwdKernelSm90 {
  // The first plan whose shared memory fits is taken. A third K stage comes first: K is waited on right after the
  // ping-pong turn is granted, so a late K idles the tensor cores (ncu on D = 128 S = 4k: 6% of all warp samples
  // waited on a K stage with two), while V is waited on one GEMM later. Two V stages let the load of block j - 1
  // overlap the GEMMs of block j. Then two Q buffers (no bubble between tiles), then O's own staging buffer.
  static constexpr FwdBufferPlan kPlans[] = {
      {2, 3, true}, {2, 3, false}, {2, 2, true}, {1, 2, true}, {1, 2, false}};
  template <int kPlan>
  using MainloopOf = FwdMainloopSm90<Element, kHeadDim, kBlockN, kPlans[kPlan].k_stages, 2, kBlockM / 64,
                                     kPlans[kPlan].q_stages, kSoftcap, kPackGqa,
                                     /*kSkipIdle=*/kSplitKv || (kVarlen_ && kPackGqa), kVarlen_, kMaskMod_>;
  static constexpr int kSmemLimitBytes = 227 * 1024;  // sm90 per-block opt-in maximum
  template <int kPlan>
  static constexpr bool kPlanFits =
      sizeof(FwdSharedStorageSm90<MainloopOf<kPlan>, kPlans[kPlan].own_o>) <= kSmemLimitBytes;
  static constexpr int kPlan = kPlanFits<0> ? 0 : kPlanFits<1> ? 1 : kPlanFits<2> ? 2 : kPlanFits<3> ? 3 : 4;
  static constexpr bool kOwnOBuffer = kPlans[kPlan].own_o;
  using Mainloop = MainloopOf<kPlan>;
  static constexpr bool kSplit = kSplitKv;
  static constexpr bool kVarlen = kVarlen_;
  static_assert(!(kVarlen && kSplitKv), "no split-keys kernel for packed sequences yet");
  static_assert(!(kVarlen && kPackGqa && kSplitKv));
  static constexpr bool kMaskMod = kMaskMod_;
  static_assert(!(kMaskMod && (kSplitKv || kVarlen || kPackGqa)), "the mask-mod kernel is dense, unpacked, unsplit");
  using Epilogue = std::conditional_t<kSplitKv, FwdSplitEpilogueSm90<Mainloop>,
                                      std::conditional_t<kVarlen, FwdVarlenEpilogueSm90<Mainloop>,
                                                         FwdEpilogueSm90<Mainloop>>>;
  using Scheduler = std::conditional_t<kVarlen, FwdVarlenTileSchedulerSm90<Mainloop::kBlockM, Mainloop::kBlockN, kPackGqa>,
                                       FwdTileSchedulerSm90<Mainloop::kBlockM, Mainloop::kBlockN>>;
  static_assert(kBlockM == Mainloop::kBlockM, "the M tile is whole 64-row consumer warpgroups");
  static_assert(Mainloop::kConsumerWarpgroups == 2 || Mainloop::kConsumerWarpgroups == 3);

  static constexpr int kConsumerThreads = Mainloop::kConsumerWarpgroups * 128;
  static constexpr int kThreads = 128 + kConsumerThreads;
  // setmaxnreg splits the 64K registers: 128 * 24 + 256 * 240 = 64512 with two consumer warpgroups,
  // 128 * 32 + 384 * 160 = 65536 with three.
  static constexpr int kProducerRegisters = Mainloop::kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters = Mainloop::kConsumerWarpgroups == 2 ? 240 : 160;
  // setmaxnreg moves registers within the CTA's pool, which holds what the launch allocated: __launch_bounds__
  // (kThreads, 1) lets ptxas give each thread 65536 / kThreads rounded down to a multiple of 8. A split above the
  // pool would leave the consumers' setmaxnreg.inc waiting forever.
  static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536 / kThreads / 8 * 8 * kThreads,
                "setmaxnreg split over the registers the launch allocates");

  using SharedStorage = FwdSharedStorageSm90<Mainloop, kOwnOBuffer>;
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemLimitBytes, "over the sm90 per-block shared memory limit");
  static_assert(!kVarlen || kThreads / 32 <= 16, "a walk_end slot per warp (fwd_mainloop.cuh)");

  // Where the epilogue stages O of a tile whose Q sat in q_buffer.
  __device__ static Element* o_staging(SharedStorage& shared, int q_buffer) {
    if constexpr (kOwnOBuffer) {
      return shared.staging.o.data();
    } else {
      return shared.tensors.q.data() + q_buffer * Mainloop::kQElems;
    }
  }

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
    int seqlen_q, seqlen_k;
    int window_left, window_right;
    float softmax_scale, softcap;
    int heads_per_kv;    // Hq / Hk: query head h reads K/V head h / heads_per_kv
    const float* sinks;  // [Hq] or nullptr
    typename Mainloop::QueryTiling tiling;  // the rows of a tile: packed GQA or not
    // kMaskMod: the call's mask bits and block lists (kernels/common/mask_block_lists.cuh); nothing otherwise.
    std::conditional_t<kMaskMod, common::MaskModTiles, typename Mainloop::NoMaskBits> mask{};
  };
};

// The thread of producer warp w that issues its loads (its lane 0): K's pipeline is fed by warp 0, V's by warp 1.
__host__ __device__ constexpr int producer_leader_thread(int warp) { return 32 * warp; }

// Parameters of K's and V's TMA pipelines (each PipelineTmaAsync depth has a Params type of its own). is_leader
// marks the thread whose producer_acquire also arms the stage's full barrier with the expected bytes: the one that
// issues that pipeline's TMA loads.
template <typename Pipeline, typename Kernel>
__device__ typename Pipeline::Params kv_pipeline_params(bool is_producer, int leader_thread) {
  typename Pipeline::Params params;
  params.transaction_bytes = Kernel::Mainloop::kTmaBytesKV;
  params.role = is_producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == leader_thread;
  // Every consumer thread releases a stage after its own wgmma wait, so none relies on its warpgroup being in step.
  params.num_consumers = Kernel::kConsumerThreads;
  return params;
}

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
  using PipelineK = typename Mainloop::PipelineK;
  using PipelineV = typename Mainloop::PipelineV;
  constexpr int kBlockM = Mainloop::kBlockM;
  constexpr int kBlockN = Mainloop::kBlockN;

  extern __shared__ char smem_bytes[];
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(smem_bytes);
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool is_producer = warpgroup == 0;
  probe::Recorder recorder;
  recorder.at_entry();

  if (threadIdx.x == 0) {
    for (auto& barrier_q : shared.barriers.q) barrier_q.init(/*arrive_count=*/1);  // the producer's expect_tx
    if constexpr (Kernel::kVarlen) {
      shared.barriers.v_past_keys.init(/*arrive_count=*/1);
      // The dynamic walk's readers: the producer's V warp and every consumer warp (the Q/K warp fetches).
      VarlenTicketRing::init(shared.barriers.ring, 1 + Kernel::kConsumerThreads / 32);
    }
  }
  PipelineK pipeline_k(shared.barriers.k, kv_pipeline_params<PipelineK, Kernel>(is_producer, producer_leader_thread(0)),
                       Shape<_1, _1, _1>{});
  PipelineV pipeline_v(shared.barriers.v, kv_pipeline_params<PipelineV, Kernel>(is_producer, producer_leader_thread(1)),
                       Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();  // barrier initialization visible to every thread (and to TMA) before first use
  // Programmatic dependent launch (the launcher's FLASHJAX_SM90_PDL): this CTA may have started while the stream's
  // previous kernel still runs. Everything above touches only shared memory and parameters; wait for that kernel
  // (its completion and its memory) before the first global access. Then let the next kernel on the stream launch
  // early: its CTAs take SMs only as ours exit (shared memory), and wait the same way. Both are no-ops without PDL.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  recorder.after_wait();

  const common::BandMask band(params.seqlen_q, params.seqlen_k, params.window_left, params.window_right);
  // Varlen: a tile's band is its sequence's, bottom-right aligned on its used lengths (docs/design.md §2.3).
  auto sequence_band = [&](const auto& tile) {
    return common::BandMask(tile.seqlen_q, tile.seqlen_k, params.window_left, params.window_right);
  };
  // Varlen with packed GQA: the tiling's rows over the tile's sequence (its positions; group and chunk order are
  // the call's).
  auto sequence_tiling = [&](const auto& tile) {
    typename Mainloop::QueryTiling tiling = params.tiling;
    tiling.seqlen_q = tile.seqlen_q;
    return tiling;
  };

  // The CTA's walk over tiles, the same for producer and consumers (Scheduler: first_tile, next_tile). A scheduled
  // tile: its index, coordinates and KV blocks (every warpgroup consumes the same K/V stages).
  struct ScheduledTile {
    int index;  // num_tiles: the CTA has no more
    typename Scheduler::Tile tile;
    typename Mainloop::BlockRange blocks;
  };
  // Varlen: the CTA's range of positions, computed by every warp from the offsets (fwd_varlen_balance.cuh;
  // warp-collective, so here, where every warp is converged); the end goes to the warp's shared slot, read per tile
  // (a register held through the mainloop cost the consumers spills). The dynamic walk starts at the CTA's index
  // and counts the warp's ring slots in that slot (fwd_varlen_ring.cuh). The dense walk needs none of it.
  const int varlen_first = [&] {
    if constexpr (Kernel::kVarlen) {
      if (params.scheduler.walk == VarlenWalk::kDynamic) {
        if (threadIdx.x % 32 == 0) shared.barriers.walk_end[threadIdx.x / 32] = 0;
        __syncwarp();
        return int(blockIdx.x);  // < num_tiles: the grid is at most num_tiles CTAs
      }
      const auto range = Scheduler::cta_range(params.scheduler, blockIdx.x, gridDim.x);
      if (threadIdx.x % 32 == 0) shared.barriers.walk_end[threadIdx.x / 32] = range.end;
      __syncwarp();
      return Scheduler::first_tile(params.scheduler, range);
    } else {
      return 0;
    }
  }();
  auto first_position = [&] {
    if constexpr (Kernel::kVarlen) {
      return varlen_first;
    } else {
      return Scheduler::first_tile(params.scheduler, blockIdx.x);
    }
  };
  auto next_position = [&](int tile_index) {
    if constexpr (Kernel::kVarlen) {
      auto& walk_slot = *static_cast<volatile int*>(&shared.barriers.walk_end[threadIdx.x / 32]);
      if (params.scheduler.walk == VarlenWalk::kDynamic) {
        // The producer's Q/K warp (threads 0-31) fetches; every other walking warp reads what it published.
        return VarlenTicketRing::next(shared.barriers.ring, walk_slot, threadIdx.x < 32, params.scheduler.tile_counter,
                                      params.scheduler.num_tiles);
      }
      // The stride from the parameters (the range's: 1, or the grid where round robin), not a register.
      return Scheduler::next_tile(params.scheduler, walk_slot,
                                  params.scheduler.walk == VarlenWalk::kBalanced ? 1 : int(gridDim.x), tile_index);
    } else {
      return Scheduler::next_tile(params.scheduler, tile_index, blockIdx.x, gridDim.x);
    }
  };
  // The next tile with work (a KV block to visit) from tile_index on; skipped(tile) for each tile on the way whose
  // rows see no key.
  auto next_tile_with_work = [&](int tile_index, auto&& skipped) {
    for (; tile_index < params.scheduler.num_tiles; tile_index = next_position(tile_index)) {
      const auto tile = Scheduler::tile(params.scheduler, tile_index);
      typename Mainloop::BlockRange blocks;
      if constexpr (Kernel::kMaskMod) {  // the band's blocks less the mod's empty tiles, listed before the kernel
        blocks = params.mask.blocks(tile.batch, tile.head, tile.m_block);
      } else if constexpr (Kernel::kVarlen) {
        if (!tile.has_rows()) continue;  // a virtual block past its sequence's used rows: nothing to load or write
        if constexpr (Mainloop::kPackGqa) {
          const auto positions = sequence_tiling(tile).positions(tile.m_block);
          blocks = sequence_band(tile).template kv_blocks_of_rows<kBlockN>(positions.first, positions.last);
        } else {
          blocks = sequence_band(tile).template kv_blocks<kBlockM, kBlockN>(tile.m_block * kBlockM);
        }
      } else if constexpr (Mainloop::kPackGqa) {
        const auto positions = params.tiling.positions(tile.m_block);
        blocks = band.template kv_blocks_of_rows<kBlockN>(positions.first, positions.last);
      } else {
        blocks = band.template kv_blocks<kBlockM, kBlockN>(tile.m_block * kBlockM);
      }
      if constexpr (Kernel::kSplit) blocks = params.epilogue.part_of(blocks, tile.batch);
      if (!blocks.empty()) return ScheduledTile{tile_index, tile, blocks};
      skipped(tile);
    }
    return ScheduledTile{tile_index, {}, {}};
  };

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Kernel::kProducerRegisters>();
    // Warp 0 loads Q and K, warp 1 V (Mainloop::load_q_k / load_v); warps 2 and 3 have nothing to do.
    const int producer_warp = cutlass::canonical_warp_idx_sync();
    if (producer_warp > 1) return;
    const bool leader = threadIdx.x == producer_leader_thread(producer_warp);
    if (leader && producer_warp == 0) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Epilogue::prefetch_tma_descriptors(params.epilogue);
    }
    auto write_k = cutlass::make_producer_start_state<PipelineK>();
    auto write_v = cutlass::make_producer_start_state<PipelineV>();
    int tiles_with_work = 0;
    uint32_t v_past_keys_phase = 0;  // varlen only (Mainloop::load_v_varlen)
    auto load_nothing = [](const typename Scheduler::Tile&) {};  // the consumers write those tiles out
    for (ScheduledTile scheduled =
             next_tile_with_work(first_position(), load_nothing);
         scheduled.index < params.scheduler.num_tiles;
         scheduled = next_tile_with_work(next_position(scheduled.index), load_nothing)) {
      const auto& tile = scheduled.tile;
      // A packed tile's head is its KV head already (group = heads_per_kv). A split kernel's tiles carry their part
      // in the batch coordinate.
      int batch = tile.batch;
      if constexpr (Kernel::kSplit) batch = params.epilogue.batch_of(tile.batch);
      const typename Mainloop::LoadCoords at = [&] {
        const int head_k = tile.head * params.tiling.group / params.heads_per_kv;
        if constexpr (Kernel::kVarlen) {
          return typename Mainloop::LoadCoords{{tile.m_block, tile.head, head_k, batch}, tile.q_start, tile.k_start,
                                               tile.seqlen_k};
        } else {
          return typename Mainloop::LoadCoords{tile.m_block, tile.head, head_k, batch};
        }
      }();
      if (producer_warp == 0) {
        Mainloop::load_q_k(params.mainloop, shared.tensors, shared.barriers, pipeline_k, write_k, leader,
                           typename Mainloop::QuerySlot(tiles_with_work++), params.tiling, at, scheduled.blocks);
      } else {
        // At kernel start every CTA's first loads meet a cold memory system at once, and the first GEMM needs Q
        // and K of the first block, V only one GEMM later: the first V waits until the first Q has landed (its
        // buffer 0, phase 0), so it does not share that burst (causal D 128 S 4k: first block done 7.0 -> 5.5 us
        // after the kernel's start, +0.7% at causal S 4k and +2-4% at causal S 1k on the H200; docs/performance.md,
        // lever table). That barrier cannot complete a second phase before this wait sees the first: the next Q
        // into buffer 0 waits for this tile's epilogue, which needs this V.
        if (tiles_with_work++ == 0) shared.barriers.q[0].wait(0);
        if constexpr (Kernel::kVarlen) {
          Mainloop::load_v_varlen(params.mainloop, shared.tensors, shared.barriers, pipeline_v, write_v, leader, at,
                                  scheduled.blocks, v_past_keys_phase);
        } else {
          Mainloop::load_v(params.mainloop, shared.tensors, pipeline_v, write_v, leader, at, scheduled.blocks);
        }
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Kernel::kConsumerRegisters>();
  const int consumer_wg = warpgroup - 1;
  const int thread_in_wg = threadIdx.x % 128;
  const common::ScoreTransform transform(params.softmax_scale, params.softcap);
  // One arrival per tile with work, plus one per buffer now (they start free): see Mainloop::load_q_k.
  auto arrive_query_empty = [](int q_buffer) {
    cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarp + Kernel::kConsumerThreads,
                                        FwdNamedBarrier::query_empty(q_buffer));
  };
  for (int q_buffer = 0; q_buffer < Mainloop::kQStages; ++q_buffer) arrive_query_empty(q_buffer);
  // Warpgroup 0 takes the first turn on the tensor cores.
  if (consumer_wg == 0) cutlass::arch::NamedBarrier::arrive(2 * 128, FwdNamedBarrier::ping_pong(0));

  // The (position, query head) of this thread's two rows of a packed tile. (Recomputed per tile from the thread
  // index: a few instructions, where keeping the rows would hold registers across the mainloop.)
  using Row = typename Mainloop::QueryTiling::Row;
  auto rows_of = [&](const typename Scheduler::Tile& tile, Row (&rows)[2]) {
    int tile_rows[2];
    Mainloop::thread_rows(thread_in_wg, tile_rows);
    for (int r = 0; r < 2; ++r) {
      rows[r] = params.tiling.row(tile.m_block, tile.head, consumer_wg * Mainloop::kRowsPerWarpgroup + tile_rows[r]);
    }
  };
  // Each row's sink logit in log2 units (-inf without sinks): the tile's head's, or each row's own where GQA is
  // packed. A split kernel's parts leave the sink to the combine, which adds it once.
  auto sink_log2_of = [&](const typename Scheduler::Tile& tile, float (&sink_log2)[2]) {
    auto sink_of = [&](int head_q) {
      return params.sinks != nullptr && !Kernel::kSplit ? params.sinks[head_q] * common::kLog2e : -INFINITY;
    };
    if constexpr (Mainloop::kPackGqa) {
      Row rows[2];
      rows_of(tile, rows);
      for (int r = 0; r < 2; ++r) sink_log2[r] = sink_of(rows[r].head_q);
    } else {
      sink_log2[0] = sink_log2[1] = sink_of(tile.head);
    }
  };
  // Tiles whose rows see no key are written out on the way to the next tile with work (out = 0, lse = -inf or
  // the sink): they use neither shared memory nor the tensor cores, so they may go while the previous tile's
  // GEMMs are still in flight.
  auto write_empty_tile = [&](const typename Scheduler::Tile& tile) {
    float sink_log2[2], lse[2];
    sink_log2_of(tile, sink_log2);
    FwdOnlineSoftmaxSm90<2>::lse_of_empty_rows(sink_log2, lse);
    if constexpr (Kernel::kVarlen) {
      Epilogue::store_empty(params.epilogue, lse, params.tiling, consumer_wg, thread_in_wg, tile);
    } else {
      Epilogue::store_empty(params.epilogue, lse, params.tiling, consumer_wg, thread_in_wg, tile.m_block, tile.head,
                            tile.batch);
    }
  };
  int tiles_with_work = 0;  // counted as the producer counts them: they alone load Q
  // The n-th tile with work, as the mainloop sees it: Q slot, KV blocks and the band mask of this thread's rows.
  auto consumer_tile = [&](const ScheduledTile& scheduled, int n) {
    const typename Mainloop::QuerySlot q_slot(n);
    if constexpr (Mainloop::kPackGqa) {
      Row rows[2];
      rows_of(scheduled.tile, rows);
      const int positions[2] = {rows[0].position, rows[1].position};
      const auto rows_mask = [&] {
        if constexpr (Kernel::kVarlen) {
          return sequence_band(scheduled.tile).rows_mask(positions);
        } else {
          return band.rows_mask(positions);
        }
      }();
      typename Mainloop::ConsumerTile work{q_slot, scheduled.blocks, rows_mask};
      if constexpr (Mainloop::kSkipIdle) {
        // The warpgroup's first row has its smallest position (chunks are numbered position-major).
        const Row first = params.tiling.row(scheduled.tile.m_block, scheduled.tile.head,
                                            consumer_wg * Mainloop::kRowsPerWarpgroup);
        if constexpr (Kernel::kVarlen) {
          work.idle = first.position >= scheduled.tile.seqlen_q;
        } else {
          work.idle = first.position >= params.seqlen_q;
        }
      }
      return work;
    } else {
      const int m_start = scheduled.tile.m_block * kBlockM + consumer_wg * Mainloop::kRowsPerWarpgroup;
      if constexpr (Kernel::kVarlen) {
        const common::TileMask mask = sequence_band(scheduled.tile).tile_mask(m_start);
        return typename Mainloop::ConsumerTile{q_slot, scheduled.blocks, mask};
      } else if constexpr (Kernel::kMaskMod) {
        typename Mainloop::ConsumerTile work{q_slot, scheduled.blocks, band.tile_mask(m_start)};
        work.bits = {params.mask.bits_rows(scheduled.tile.batch, scheduled.tile.head), m_start};
        return work;
      } else {
        return typename Mainloop::ConsumerTile{q_slot, scheduled.blocks, band.tile_mask(m_start)};
      }
    }
  };

  typename Mainloop::ConsumerState state;
  typename Mainloop::TiledMmaPV mma_pv;
  Tensor acc_o = partition_fragment_C(mma_pv, Shape<typename Mainloop::WgRows, typename Mainloop::HeadDim>{});
  FwdOnlineSoftmaxSm90<2, Mainloop::kLazyRescale> softmax(transform.exp2_scale);

  // This tile's epilogue: normalize O, stage it in shared memory, TMA store, LSE.
  auto store_tile = [&](const typename Scheduler::Tile& tile, const typename Mainloop::ConsumerTile& work) {
    float sink_log2[2], lse[2];
    sink_log2_of(tile, sink_log2);
    Tensor acc_o_rc = common::wgmma_acc_rowcol_view(acc_o);
    softmax.finalize(acc_o_rc, sink_log2, lse);
    if constexpr (Kernel::kVarlen) {
      Epilogue::template store<Kernel::kOwnOBuffer>(params.epilogue, Kernel::o_staging(shared, work.q_slot.buffer),
                                                    acc_o, lse, params.tiling, consumer_wg, thread_in_wg, tile);
    } else {
      Epilogue::template store<Kernel::kOwnOBuffer>(params.epilogue, Kernel::o_staging(shared, work.q_slot.buffer),
                                                    acc_o, lse, params.tiling, consumer_wg, thread_in_wg,
                                                    tile.m_block, tile.head, tile.batch);
    }
    // O was staged in the Q buffer: free only now that the TMA store has read it.
    if constexpr (!Kernel::kOwnOBuffer) arrive_query_empty(work.q_slot.buffer);
  };

  ScheduledTile scheduled =
      next_tile_with_work(first_position(), write_empty_tile);
  if (scheduled.index < params.scheduler.num_tiles) {
    auto tile = scheduled.tile;
    auto work = consumer_tile(scheduled, tiles_with_work++);
    Mainloop::first_block(shared.tensors, shared.barriers, pipeline_k, state, work, consumer_wg, thread_in_wg,
                          transform, acc_o, softmax);
    recorder.first_block_done();
    while (true) {
      Mainloop::steady_blocks(shared.tensors, pipeline_k, pipeline_v, state, work, consumer_wg, thread_in_wg,
                              transform, acc_o, softmax);
      // Every wgmma that reads this tile's Q has been waited on: with O staged elsewhere, a later Q may land now.
      if constexpr (Kernel::kOwnOBuffer) arrive_query_empty(work.q_slot.buffer);
      scheduled = next_tile_with_work(next_position(scheduled.index), write_empty_tile);
      if (scheduled.index >= params.scheduler.num_tiles) break;

      const auto next_tile = scheduled.tile;
      const auto next_work = consumer_tile(scheduled, tiles_with_work++);
      if constexpr (Mainloop::kCanPrefetchQuery) {
        // The next tile's first GEMM goes out with this tile's last one (its Q has a buffer of its own), and runs
        // while this tile's epilogue does.
        Mainloop::tail_and_prefetch(shared.tensors, shared.barriers, pipeline_k, pipeline_v, state, next_work,
                                    consumer_wg, thread_in_wg, acc_o);
        store_tile(tile, work);
        recorder.tile_done(tile.m_block, work.blocks.num_blocks(), tile.head);
        Mainloop::finish_prefetch(pipeline_k, state, next_work, thread_in_wg, transform, acc_o, softmax);
      } else {
        Mainloop::tail(shared.tensors, pipeline_v, state, consumer_wg, thread_in_wg, acc_o);
        store_tile(tile, work);
        recorder.tile_done(tile.m_block, work.blocks.num_blocks(), tile.head);
        Mainloop::first_block(shared.tensors, shared.barriers, pipeline_k, state, next_work, consumer_wg,
                              thread_in_wg, transform, acc_o, softmax);
      }
      tile = next_tile;
      work = next_work;
    }
    Mainloop::tail(shared.tensors, pipeline_v, state, consumer_wg, thread_in_wg, acc_o);
    store_tile(tile, work);
    recorder.tile_done(tile.m_block, work.blocks.num_blocks(), tile.head);
  }
  recorder.at_exit();
  Epilogue::drain(thread_in_wg);
#endif
}

}  // namespace flashjax::sm90

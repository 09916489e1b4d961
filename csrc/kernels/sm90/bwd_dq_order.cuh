// deterministic=True for the sm90 backward: the order in which the CTAs of one KV head add their partials into a
// query block's dQ. Floating-point addition is not associative, so the bulk reduce-adds, which the L2 performs in
// whatever order they arrive, make dQ differ in its last bits from run to run; fixing the order makes it bitwise
// reproducible (dK and dV are already: each CTA stores its own once).
//
// One counter per (batch, query head, query block) in BwdParams::dq_semaphore, zeroed by the launcher. The CTAs
// that add into a block take turns by rank: a CTA waits until the counter equals the number of contributors ranked
// before it, adds, waits for its add to complete, and increments. A CTA counts the contributors before it with the
// same function that gives every CTA its steps (BwdBandMask::m_blocks), so the count is exact for any band. With a
// mask mod a CTA visits only the query blocks its list holds (common/mask_query_block_lists.cuh: the band's range less
// the mod's empty tiles), so the count also asks the tile classes the lists were built from: a key block adds into a
// query block exactly when its list holds it.
//
// Deadlock freedom and speed: a CTA only ever waits for CTAs launched before it (the hardware starts blocks in
// index order), so the earliest unfinished CTA never waits. Without a right edge to the band every CTA starts at
// the first query block, and the order is by increasing key block, the launch order. With one (causal, windows),
// later key blocks start at later query blocks and have fewer steps, so they go first twice over: the grid is
// launched from the last key block (n_block()) and ranks count the later key blocks, so a CTA reaches each query
// block after the ones ranked before it have passed it and rarely waits.
#pragma once

#include <cutlass/arch/barrier.h>

#include "kernels/common/bwd_band_mask.cuh"

namespace flashjax::sm90 {

struct BwdDqOrder {
  int* semaphores = nullptr;  // the call's counters; nullptr: any order (not deterministic)
  bool from_last = false;     // launch from the last key block and rank by later key blocks first

  __host__ __device__ static BwdDqOrder of(int* semaphores, int window_right) {
    return {semaphores, semaphores != nullptr && window_right >= 0};
  }
  __device__ bool enabled() const { return semaphores != nullptr; }

  // The key block that CTA index `cta` of `num_n_blocks` works on.
  __device__ int n_block(int cta, int num_n_blocks) const { return from_last ? num_n_blocks - 1 - cta : cta; }

  // Every key block of the band visits its query blocks (no mask mod).
  struct EveryBandBlock {
    __device__ bool operator()(int) const { return true; }
  };

  // How many key blocks other than n_block add into query block m_block before it; all lanes of the warp call it
  // and get the same count. visits(other): whether key block `other` visits m_block where the band says it may (with
  // a mask mod: common::NonEmptyTiles, its tile is not empty).
  template <int kBlockM, int kBlockN, typename Visits = EveryBandBlock>
  __device__ int rank(const common::BwdBandMask& mask, int n_block, int num_n_blocks, int m_block,
                      const Visits& visits = {}) const {
    const int lane = threadIdx.x % cutlass::NumThreadsPerWarp;
    const int first = from_last ? n_block + 1 : 0;
    const int last = from_last ? num_n_blocks : n_block;  // exclusive
    int count = 0;
    for (int base = first; base < last; base += cutlass::NumThreadsPerWarp) {
      const int other = base + lane;
      bool adds = false;
      if (other < last) {
        const common::MBlockRange range = mask.m_blocks<kBlockM, kBlockN>(other * kBlockN);
        adds = range.begin <= m_block && m_block < range.end && visits(other);
      }
      count += __popc(__ballot_sync(0xffffffffu, adds));
    }
    return count;
  }

  // One thread: spins until `counter` reaches `turn`. The acquire orders the caller's later bulk reduce-adds
  // (async proxy, hence the proxy fence) after the adds of the CTAs ranked before it.
  __device__ static void wait_turn(const int* counter, int turn) {
    int seen;
    while (true) {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
      if (seen == turn) break;
      __nanosleep(64);
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
  }

  // One thread, after its bulk adds into the block have completed (cp.async.bulk.wait_group 0): hands the turn on.
  __device__ static void pass_turn(int* counter) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
  }
};

}  // namespace flashjax::sm90

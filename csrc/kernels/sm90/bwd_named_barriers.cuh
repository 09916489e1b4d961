// Named barrier (bar.sync / bar.arrive) ids of the sm90 backward kernel, after the ids CUTLASS reserves.
#pragma once

#include <cstdint>

namespace flashjax::sm90 {

struct BwdNamedBarrier {
  static constexpr uint32_t kMmaWarpgroups = 2;
  // MMA warpgroup w -> the dQ writer warp: w's share of this step's dQ is staged in shared memory (128 + 32 threads).
  static constexpr uint32_t kDqFullBase = 0;
  // The dQ writer warp -> MMA warpgroup w: the bulk reduce has read w's staging buffer, the next dQ may go in.
  static constexpr uint32_t kDqEmptyBase = kDqFullBase + kMmaWarpgroups;
  // Both MMA warpgroups (256 threads): after dS is written (the whole dS is in shared memory for this step's dQ
  // GEMM) and, where there is one dS buffer (kByHeadDim), also before (the other warpgroup's GEMMs of the previous
  // step have read dS and P).
  static constexpr uint32_t kDsSync = kDqEmptyBase + kMmaWarpgroups;
  static_assert(kDsSync + 1 <= 8, "ids 0..7: CUTLASS offsets user ids past its reserved ones, and a CTA has 16");

  __device__ static constexpr uint32_t dq_full(int warpgroup) { return kDqFullBase + warpgroup; }
  __device__ static constexpr uint32_t dq_empty(int warpgroup) { return kDqEmptyBase + warpgroup; }
};

}  // namespace flashjax::sm90

// Named barrier (bar.sync / bar.arrive) ids of the sm90 tangent kernel, after the ids CUTLASS reserves.
#pragma once

#include <cstdint>

namespace flashjax::sm90 {

struct TangentNamedBarrier {
  // Per consumer warpgroup, its 128 threads: the hand-offs of its Q half in the epilogue (every warp past the
  // mainloop's last wgmma wait before TMA loads O there; t_out written before the TMA store reads it).
  static constexpr uint32_t kEpilogueBase = 0;
  // Ping-pong, as the forward's (fwd_named_barriers.cuh): warpgroup w waits on ping_pong(w) before issuing its GEMMs
  // and, once they are issued, arrives on that of the other (256 threads: the waiting warpgroup and the granting one).
  static constexpr uint32_t kPingPongBase = 2;
  static_assert(kPingPongBase + 2 <= 8, "ids 0..7: CUTLASS offsets user ids past its reserved ones");

  __device__ static constexpr uint32_t epilogue(int warpgroup) { return kEpilogueBase + warpgroup; }
  __device__ static constexpr uint32_t ping_pong(int warpgroup) { return kPingPongBase + warpgroup; }
};

}  // namespace flashjax::sm90

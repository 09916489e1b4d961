// Named barrier (bar.sync / bar.arrive) ids of the sm90 forward kernel, after the ids CUTLASS reserves.
#pragma once

#include <cstdint>

namespace flashjax::sm90 {

struct FwdNamedBarrier {
  // Consumers -> producer: the Q buffer is free (the previous tile's O left it), Q of the next tile may land.
  // 256 consumer threads arrive, the producer warp syncs: 288 threads.
  static constexpr uint32_t kQueryEmpty = 0;
  // Ping-pong: warpgroup w waits on ping_pong(w) before issuing its GEMMs and, once they are issued, arrives on
  // the other's, so the two warpgroups take turns on the tensor cores (256 threads).
  static constexpr uint32_t kPingPongBase = 1;
  // Per consumer warpgroup: its 128 threads in the epilogue (O staged in shared memory, TMA store done reading).
  static constexpr uint32_t kEpilogueBase = 3;

  __device__ static constexpr uint32_t ping_pong(int warpgroup) { return kPingPongBase + warpgroup; }
  __device__ static constexpr uint32_t epilogue(int warpgroup) { return kEpilogueBase + warpgroup; }
};

}  // namespace flashjax::sm90

// Named barrier (bar.sync / bar.arrive) ids of the sm90 forward kernel, after the ids CUTLASS reserves.
#pragma once

#include <cstdint>

namespace flashjax::sm90 {

struct FwdNamedBarrier {
  // Consumers -> producer, one per Q buffer: the buffer is free (the wgmmas of the tile that used it are done and,
  // where O is staged in it, the O store has read it), a later tile's Q may land. Every consumer thread arrives,
  // the producer warp syncs.
  static constexpr uint32_t kQueryEmptyBase = 0;
  static constexpr uint32_t kMaxQueryBuffers = 2;
  // Ping-pong: warpgroup w waits on ping_pong(w) before issuing its GEMMs and, once they are issued, arrives on
  // that of warpgroup (w + 1) % n, so the consumer warpgroups take turns on the tensor cores in a fixed round
  // (256 threads: the waiting warpgroup and the one granting the turn).
  static constexpr uint32_t kPingPongBase = kQueryEmptyBase + kMaxQueryBuffers;
  // Per consumer warpgroup: its 128 threads in the epilogue (O staged in shared memory, TMA store done reading).
  static constexpr uint32_t kMaxConsumerWarpgroups = 3;
  static constexpr uint32_t kEpilogueBase = kPingPongBase + kMaxConsumerWarpgroups;

  // Ids 0..7: CUTLASS offsets user ids past its reserved ones, and a CTA has 16.
  static_assert(kEpilogueBase + kMaxConsumerWarpgroups <= 8);

  __device__ static constexpr uint32_t query_empty(int buffer) { return kQueryEmptyBase + buffer; }
  __device__ static constexpr uint32_t ping_pong(int warpgroup) { return kPingPongBase + warpgroup; }
  __device__ static constexpr uint32_t epilogue(int warpgroup) { return kEpilogueBase + warpgroup; }
};

}  // namespace flashjax::sm90

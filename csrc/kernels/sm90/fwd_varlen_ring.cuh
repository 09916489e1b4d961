// The dynamic varlen walk of the sm90 forward (FLASHJAX_SM90_VARLEN_WALK=2, fwd_varlen_scheduler.cuh's
// VarlenWalk::kDynamic): CTA c starts at position c, and every later position comes from one global counter, ticket
// t giving position grid + t (num_tiles once the walk is used up).
//
// Why at run time. The tiles' costs follow the lengths, which are device data; any static split is either unbalanced
// (round robin: the busiest CTA ~1.2x the mean for causal packs) or spreads concurrent CTAs over distant sequences
// (the balanced ranges, which then no longer share K/V in L2). A CTA that takes the next position when it is free
// balances by itself while the CTAs running at once stay on neighbouring positions.
//
// Who sees the position. Five or more warps walk the tiles (the producer's Q/K and V warps, each consumer warp), and
// every pipeline between them counts stages per tile, so they must all see the same positions in the same order. One
// warp fetches: the producer's Q/K warp, which runs ahead of the others (it is the first to need the next tile). It
// publishes each position (the sentinel num_tiles included) in a ring of kDepth shared-memory slots; every other
// walking warp reads every slot once, in order. A slot is reused only once all readers have read it (mbarriers: a
// full one per slot that the fetcher arrives on, an empty one that each reading warp arrives on).
//
// Why no deadlock. The fetcher publishes the position after p only once it has issued p's loads, and waits for a free
// slot only on readers that are kDepth positions behind; a reader reaches a slot after finishing the position before
// it, whose loads were issued before that slot was published. So every wait of the ring is on work that has all its
// data coming. Depth: the fetcher runs about as far ahead as its two Q buffers let it (two positions); two more
// slots cover positions without work between (they take slots but no buffers).
//
// Each warp's count of the slots it has fetched or read lives in shared memory (its walk_end slot, which the
// dynamic walk does not need): a register held through the consumers' mainloop cost spills.
#pragma once

#include <cstdint>

namespace flashjax::sm90 {

struct VarlenTicketRing {
  static constexpr int kDepth = 4;

  struct Storage {
    uint64_t full[kDepth];   // phase completes when the fetcher has written the slot (1 arrival)
    uint64_t empty[kDepth];  // phase completes when every reading warp has read it
    int position[kDepth];
  };

  // The n-th slot a warp fetches or reads (n from 0): where, and which phase of its barriers it waits on (the
  // fetcher waits on the empty barrier's other parity: a fresh barrier counts the phase before its first as done).
  // Host and device: tests/cpp/test_varlen_scheduler.cu runs the protocol on a model of the barriers.
  __host__ __device__ static int slot_of(int n) { return n % kDepth; }
  __host__ __device__ static uint32_t parity_of(int n) { return (n / kDepth) & 1; }
  // The position ticket t gives on a grid of `grid` CTAs (grid <= num_tiles), num_tiles once the walk is used up.
  // Tickets start at 0 and each CTA draws one past the end at most, but the comparison never forms grid + t (num_tiles
  // may be near INT_MAX); a negative one (a counter nobody zeroed) ends the walk rather than leave [0, num_tiles).
  __host__ __device__ static int position_of_ticket(int ticket, int grid, int num_tiles) {
    return ticket >= 0 && ticket < num_tiles - grid ? grid + ticket : num_tiles;
  }

#if defined(__CUDA_ARCH__)
  // mbarrier operations on a CTA's own shared memory, with the memory clobber that keeps the compiler from moving the
  // slot's plain accesses across them (arrive releases and try_wait acquires at CTA scope, the PTX defaults).
  __device__ static uint32_t address(const uint64_t* barrier) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(barrier));
  }
  __device__ static void init_barrier(uint64_t* barrier, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(address(barrier)), "r"(count) : "memory");
  }
  __device__ static void arrive(uint64_t* barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(address(barrier)) : "memory");
  }
  __device__ static void wait(uint64_t* barrier, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "ring_wait:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra ring_wait;\n\t}" ::"r"(address(barrier)),
        "r"(parity)
        : "memory");
  }

  // One thread, before the CTA's barrier-init fence and __syncthreads. readers: the warps that read every slot.
  __device__ static void init(Storage& ring, int readers) {
    for (int i = 0; i < kDepth; ++i) {
      init_barrier(&ring.full[i], 1);
      init_barrier(&ring.empty[i], readers);
    }
  }

  // The next position of the dynamic walk, for a whole converged warp; count: the warp's shared slot of how many
  // slots it has fetched or read. fetcher: the warp that takes tickets from counter and publishes them.
  __device__ static int next(Storage& ring, volatile int& count, bool fetcher, int32_t* counter, int num_tiles) {
    const int lane = threadIdx.x % 32;
    const int n = count;
    const int slot = slot_of(n);
    const uint32_t parity = parity_of(n);
    int position;
    if (fetcher) {
      int ticket = 0;
      if (lane == 0) ticket = atomicAdd(counter, 1);
      ticket = __shfl_sync(0xffffffffu, ticket, 0);
      position = position_of_ticket(ticket, static_cast<int>(gridDim.x), num_tiles);
      wait(&ring.empty[slot], parity ^ 1);
      if (lane == 0) {
        *static_cast<volatile int*>(&ring.position[slot]) = position;
        arrive(&ring.full[slot]);
      }
    } else {
      wait(&ring.full[slot], parity);
      position = *static_cast<volatile int*>(&ring.position[slot]);
      __syncwarp();  // every lane has read the slot before it is handed back
      if (lane == 0) arrive(&ring.empty[slot]);
    }
    __syncwarp();  // every lane has read count
    if (lane == 0) count = n + 1;
    __syncwarp();
    return position;
  }
#endif
};

}  // namespace flashjax::sm90

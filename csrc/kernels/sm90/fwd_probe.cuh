// Diagnostic only: per-CTA timelines of the sm90 forward kernel (lab/README.md). Compiled in with
// -DFLASHJAX_PROBE into one kernel file (`lab/tools/codegen_variant.sh probe -DFLASHJAX_PROBE`), read back through
// flashjax_probe_read by lab/tools/cta_timeline.py. Without the macro every hook is empty and the kernel's code is the
// same instruction for instruction (hot-loop fingerprint unchanged). Each record is one (launch, CTA), written by
// consumer warpgroup 0's first thread: globaltimer and clock64 at entry, after griddepcontrol.wait, after the first
// block, after each tile's epilogue and at exit, with the SM id.
#pragma once

#include <cstdint>

namespace flashjax::sm90::probe {

constexpr int kLaunches = 64;   // records kept per CTA: its first 64 launches after a reset
constexpr int kCtas = 160;
constexpr int kSlots = 64;
// Slots of one (launch, CTA) record.
enum Slot : int {
  kSmid = 0, kEntry = 1, kAfterWait = 2, kFirstBlockDone = 3, kExit = 4, kTiles = 5, kClockEntry = 6,
  kClockExit = 7, kTileBase = 8  // then per tile: end time, (m_block | blocks << 16 | head << 32)
};
constexpr int kMaxTiles = (kSlots - kTileBase) / 2;

#if defined(FLASHJAX_PROBE)
__device__ uint64_t records[kLaunches][kCtas][kSlots];
__device__ int launches[kCtas];

__device__ __forceinline__ uint64_t now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ bool is_recording_thread() { return threadIdx.x == 128; }  // consumer warpgroup 0's first
struct Recorder {
  uint64_t* record = nullptr;  // set in after_wait, on the recording thread only
  int tiles = 0;
  uint64_t entry = 0, clock_entry = 0;
  __device__ void at_entry() {
    if (!is_recording_thread()) return;
    entry = now();
    clock_entry = clock64();
  }
  __device__ void after_wait() {
    if (!is_recording_thread() || blockIdx.x >= kCtas) return;
    const int launch = launches[blockIdx.x]++;
    if (launch >= kLaunches) return;
    record = records[launch][blockIdx.x];
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    record[kSmid] = smid;
    record[kEntry] = entry;
    record[kClockEntry] = clock_entry;
    record[kAfterWait] = now();
  }
  __device__ void first_block_done() {
    if (record != nullptr) record[kFirstBlockDone] = now();
  }
  __device__ void tile_done(int m_block, int blocks, int head) {
    if (record == nullptr) return;
    if (tiles < kMaxTiles) {
      record[kTileBase + 2 * tiles] = now();
      record[kTileBase + 2 * tiles + 1] =
          uint64_t(m_block) | (uint64_t(blocks) << 16) | (uint64_t(uint32_t(head)) << 32);
    }
    ++tiles;
  }
  __device__ void at_exit() {
    if (record == nullptr) return;
    record[kTiles] = tiles;
    record[kClockExit] = clock64();
    record[kExit] = now();
  }
};
#else
struct Recorder {
  __device__ void at_entry() {}
  __device__ void after_wait() {}
  __device__ void first_block_done() {}
  __device__ void tile_done(int, int, int) {}
  __device__ void at_exit() {}
};
#endif

}  // namespace flashjax::sm90::probe

#if defined(FLASHJAX_PROBE)
#include <cuda_runtime.h>
// Copies the records (kLaunches x kCtas x kSlots uint64) into dst and, with reset, zeroes them and the launch
// counters. Returns a cudaError_t.
extern "C" __attribute__((visibility("default"))) int flashjax_probe_read(void* dst, int reset) {
  using namespace flashjax::sm90::probe;
  cudaDeviceSynchronize();
  cudaError_t err = cudaSuccess;
  if (dst != nullptr) err = cudaMemcpyFromSymbol(dst, records, sizeof(records));
  if (err == cudaSuccess && reset) {
    static uint64_t zeros[kLaunches][kCtas][kSlots];
    static int zero_counts[kCtas];
    err = cudaMemcpyToSymbol(records, zeros, sizeof(records));
    if (err == cudaSuccess) err = cudaMemcpyToSymbol(launches, zero_counts, sizeof(zero_counts));
  }
  cudaDeviceSynchronize();
  return static_cast<int>(err);
}
#endif

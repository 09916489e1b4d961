// Which positions of the varlen walk (fwd_varlen_scheduler.cuh) each CTA of the sm90 forward takes: a contiguous
// range of equal modelled cost, computed on the device from the offsets, by every warp that walks, at kernel start.
//
// Why. The walk's tiles differ in work by the lengths (device data): handed out round robin (CTA c takes c, c +
// grid, ...), each CTA's load is a sum of ~40 random tile costs, and the kernel lasts as long as its busiest CTA:
// in the dense planner's cost model (5 per KV block + 8 per tile), 1.21x of the mean CTA for 64 causal sequences of
// 1..1024 tokens at H 16 (worst packing of 20: 1.58), where a run-time hand-out would give 1.03
// (lab/experiments/varlen_order_sim.py). A run-time hand-out needs a counter zeroed per launch (a workspace the
// lowering allocates, and a hand-off of tile indices from producer to consumers); the host knows no lengths. So each
// CTA computes its share itself: position p (of the walk's order, head-major, virtual blocks within a head) costs
// cost(p) in the model, W is the sum over all positions, and CTA c takes the positions whose cost midpoint lies in
// [c W / grid, (c + 1) W / grid). The ranges cover [0, num_tiles) disjointly whatever the model says (each bound is
// "the first position whose midpoint reaches the target", monotone in the target), so the model decides balance
// only, never correctness. Model: 1.03x for the 64-sequence pack (worst 1.04), 1.003x for 1000 of 0..512. Each CTA
// walks consecutive blocks of a few sequences, re-reading each sequence's K/V right after it read it (L2).
//
// The model per position: virtual block v of a head belongs to the sequence b owning it, [g_b, g_{b+1}) with g_b the
// running maximum of the sequences' first virtual blocks (so that malformed offsets still give ordered ranges;
// blocks before g_0 belong to none and cost 1). Its first ceil(used_q / kBlockM) blocks have rows: the first and last
// of them cost 5 x (their KV blocks, BandMask on the used lengths) + 8, the ones between are interpolated linearly
// (exact for causal Sq = Sk at kBlockM = kBlockN, and for no band); the other blocks it owns cost 1. The prefix of a
// sequence's interpolated costs has a closed form, so nothing walks a sequence block by block.
//
// Cost: lanes take the sequences in chunks of ceil(N / 32); three passes over a chunk (first blocks' running max,
// costs, then the search for the CTA's two bounds, which only the lanes holding them walk). For N = 64 a few hundred
// cycles; N = 1000 a few microseconds at kernel start. Host and device: the host tests run the same phases lane by
// lane (tests/cpp/test_varlen_scheduler.cu).
#pragma once

#include <cstdint>

#include "kernels/common/band_mask.cuh"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/varlen.cuh"

namespace flashjax::sm90 {

// How the varlen walk numbers a head's blocks: sequence b's tiles are virtual blocks [first_block(b), ...), and
// num_blocks bounds them all from the static shapes only (kernels/common/varlen.cuh for one query head per tile).
// Packed GQA (kPacked, fwd_query_tiling.cuh): a tile holds kBlockM / 8 chunks of 8 positions of the group's G query
// heads, so sequence b needs ceil(G ceil(L_b / 8) / (kBlockM / 8)) tiles, and its first block is
// floor(G (start_b / 8 + b) / (kBlockM / 8)) + b: consecutive firsts differ by at least that many (the floors lose
// less than one block each, the + b term gives it back), and first_block(N - 1) < num_blocks.
template <int kBlockM, bool kPacked>
struct VarlenBlockNumbering {
  static constexpr int kChunkRows = 8;  // kPackedChunkRows
  static constexpr int kChunksPerTile = kBlockM / kChunkRows;

  __host__ __device__ static int first_block(const int32_t* cu_seqlens, int b, int total, int group) {
    if constexpr (kPacked) {
      return int(int64_t(group) * (common::clamp_offset(cu_seqlens[b], total) / kChunkRows + b) / kChunksPerTile) + b;
    } else {
      return common::varlen_first_block<kBlockM>(cu_seqlens, b, total);
    }
  }
  __host__ __device__ static int64_t num_blocks(int total, int num_seqs, int group) {
    if constexpr (kPacked) {
      return int64_t(group) * (total / kChunkRows + num_seqs) / kChunksPerTile + num_seqs;
    } else {
      return common::varlen_num_blocks(total, num_seqs, kBlockM);
    }
  }
  // Tiles with rows of a sequence using `used` query rows.
  __host__ __device__ static int row_blocks(int used, int group) {
    if constexpr (kPacked) {
      return int((int64_t(group) * common::ceil_div(used, kChunkRows) + kChunksPerTile - 1) / kChunksPerTile);
    } else {
      return common::ceil_div(used, kBlockM);
    }
  }
  // The positions [first, last] within its sequence that tile m (< row_blocks) spans (FwdQueryTiling::positions).
  struct Positions {
    int first, last;
  };
  __host__ __device__ static Positions positions(int m, int used, int group) {
    if constexpr (kPacked) {
      const int64_t chunks = int64_t(group) * common::ceil_div(used, kChunkRows);
      const int64_t first_chunk = int64_t(m) * kChunksPerTile;
      const int64_t end_chunk = first_chunk + kChunksPerTile < chunks ? first_chunk + kChunksPerTile : chunks;
      const int64_t end_position = (end_chunk - 1) / group * kChunkRows + kChunkRows;
      return {int(first_chunk / group * kChunkRows), int(end_position < used ? end_position : used) - 1};
    } else {
      return {m * kBlockM, min(m * kBlockM + kBlockM, used) - 1};
    }
  }
};

// What the balance reads: the scheduler's offsets and shapes.
struct VarlenBalanceInputs {
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_q;  // nullptr: every row of the slot
  const int32_t* seqused_k;
  int num_seqs;    // N >= 1
  int total_q;     // Tq
  int total_k;     // Tk
  int num_blocks;  // virtual blocks per head
  int heads;      // of the walk: Hq, or Hk where GQA is packed
  int group;      // query heads per tile (1 unpacked)
  int window_left, window_right;
};

template <int kBlockM, int kBlockN, bool kPacked = false>
struct VarlenBalance {
  using Numbering = VarlenBlockNumbering<kBlockM, kPacked>;
  // The dense planner's model (fwd_tile_scheduler.cuh), KV blocks capped so that every sum fits int64 exactly.
  static constexpr int64_t kCostPerBlock = 5;
  static constexpr int64_t kCostPerTile = 8;
  static constexpr int64_t kCostWithoutRows = 1;
  static constexpr int kMaxModelledBlocks = 1 << 16;

  __host__ __device__ static int64_t floor_div(int64_t a, int64_t b) {  // b > 0
    const int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
  }

  // One sequence's blocks in the model: their first virtual block is g.
  struct Sequence {
    int first;     // its first virtual block, f_b (before the running maximum)
    int row_blocks;
    int64_t c0, d;  // cost of its first row block, last minus first

    // Modelled cost of its first i row blocks (0 <= i <= row_blocks): sum_{j < i} c0 + d j / (row_blocks - 1),
    // floored; non-decreasing in i (each step >= min(first, last) - 1 >= 7).
    __host__ __device__ int64_t rows_cost(int i) const {
      if (i == row_blocks) return int64_t(i) * c0 + floor_div(d * i, 2);  // the general form's value at i = n
      const int64_t two_n1 = 2 * int64_t(row_blocks > 1 ? row_blocks - 1 : 1);
      const int64_t a = int64_t(i) * (i - 1);  // <= 2^48
      return int64_t(i) * c0 + d * (a / two_n1) + floor_div(d * (a % two_n1), two_n1);
    }
    // Cost of its first i owned blocks, `owned` of them (rows first, then blocks without rows).
    __host__ __device__ int64_t owned_cost(int i) const {
      const int rows = i < row_blocks ? i : row_blocks;
      return rows_cost(rows) + (i - rows) * kCostWithoutRows;
    }
  };

  __host__ __device__ static int first_block(const VarlenBalanceInputs& in, int b) {
    return b < in.num_seqs ? Numbering::first_block(in.cu_seqlens_q, b, in.total_q, in.group) : in.num_blocks;
  }

  __host__ __device__ static Sequence sequence(const VarlenBalanceInputs& in, int b) {
    const common::VarlenRows q = common::varlen_rows(in.cu_seqlens_q, in.seqused_q, b, in.total_q);
    const common::VarlenRows k = common::varlen_rows(in.cu_seqlens_k, in.seqused_k, b, in.total_k);
    Sequence s;
    s.first = Numbering::first_block(in.cu_seqlens_q, b, in.total_q, in.group);
    s.row_blocks = Numbering::row_blocks(q.used, in.group);
    s.c0 = s.d = 0;
    if (s.row_blocks > 0) {
      const common::BandMask band(q.used, k.used, in.window_left, in.window_right);
      auto cost_of = [&](int m) {
        const auto rows = Numbering::positions(m, q.used, in.group);
        const int blocks = band.template kv_blocks_of_rows<kBlockN>(rows.first, rows.last).num_blocks();
        return kCostPerBlock * (blocks < kMaxModelledBlocks ? blocks : kMaxModelledBlocks) + kCostPerTile;
      };
      s.c0 = cost_of(0);
      s.d = cost_of(s.row_blocks - 1) - s.c0;
    }
    return s;
  }

  // Lane `lane` of `lanes` takes sequences [begin, end).
  struct Chunk {
    int begin, end;
  };
  __host__ __device__ static Chunk chunk(const VarlenBalanceInputs& in, int lane, int lanes) {
    const int size = (in.num_seqs + lanes - 1) / lanes;
    const int64_t begin = int64_t(lane) * size, end = begin + size;
    return {int(begin < in.num_seqs ? begin : in.num_seqs), int(end < in.num_seqs ? end : in.num_seqs)};
  }

  // Phase 1: the largest first virtual block of the lane's chunk (-1 if empty).
  __host__ __device__ static int chunk_max_first(const VarlenBalanceInputs& in, int lane, int lanes) {
    const Chunk c = chunk(in, lane, lanes);
    int m = -1;
    for (int b = c.begin; b < c.end; ++b) m = max(m, first_block(in, b));
    return m;
  }

  // Phase 2: the modelled cost of the blocks the chunk's sequences own; carry = the running maximum of the first
  // blocks before the chunk (-1 for none).
  __host__ __device__ static int64_t chunk_cost(const VarlenBalanceInputs& in, int lane, int lanes, int carry) {
    const Chunk c = chunk(in, lane, lanes);
    int64_t cost = 0;
    for (int b = c.begin; b < c.end; ++b) {
      const Sequence s = sequence(in, b);
      const int g = max(carry, s.first);
      const int g_next = max(g, first_block(in, b + 1));
      cost += s.owned_cost(g_next - g);
      carry = g;
    }
    return cost;
  }

  // Phase 3: the first virtual block in the chunk whose cost midpoint reaches target (2 x midpoint >= 2 x target),
  // or num_blocks if none; base = the modelled cost of the head's blocks before the chunk.
  __host__ __device__ static int chunk_search(const VarlenBalanceInputs& in, int lane, int lanes, int carry,
                                              int64_t base, int64_t own_cost, int64_t target) {
    if (base + own_cost < target) return in.num_blocks;  // every midpoint lies below the target
    const Chunk c = chunk(in, lane, lanes);
    for (int b = c.begin; b < c.end; ++b) {
      const Sequence s = sequence(in, b);
      const int g = max(carry, s.first);
      const int owned = max(g, first_block(in, b + 1)) - g;
      carry = g;
      if (owned == 0) continue;
      // Midpoint of owned block i, doubled: 2 base + cost(< i) + cost(<= i); non-decreasing in i.
      auto mid2 = [&](int i) { return 2 * base + s.owned_cost(i) + s.owned_cost(i + 1); };
      if (mid2(owned - 1) >= 2 * target) {
        int lo = 0, hi = owned - 1;  // the first i with mid2(i) >= 2 target lies in [lo, hi]
        while (lo < hi) {
          const int mid = lo + (hi - lo) / 2;
          if (mid2(mid) >= 2 * target) {
            hi = mid;
          } else {
            lo = mid + 1;
          }
        }
        return g + lo;
      }
      base += s.owned_cost(owned);
    }
    return in.num_blocks;
  }

  // CTA c's target: floor(c x total / grid) without overflow (total <= num_tiles x 2^20 x 5 < 2^54).
  __host__ __device__ static int64_t target_of(int64_t total, int c, int grid) {
    return (total / grid) * c + (total % grid) * c / grid;
  }

  // The walk position of a head-level answer: target t of the whole walk, W the cost of one head, g0 the first
  // owned block, search(t') the lanes' combined chunk_search for a head-local target t' >= g0.
  template <typename Search>
  __host__ __device__ static int position_of(const VarlenBalanceInputs& in, int64_t t, int64_t head_cost, int g0,
                                             Search&& search) {
    const int64_t head = t / head_cost;
    const int64_t local = t - head * head_cost;
    // Blocks before g0 cost 1 each: block v's doubled midpoint is 2 v + 1.
    const int v = local < g0 ? int(local) : search(local - g0);
    return int(head * in.num_blocks + v);
  }

  struct Range {
    int begin, end;  // positions begin, begin + stride, ... below end of the walk
    int stride;      // 1; the grid where tiles go out round robin (FLASHJAX_SM90_VARLEN_WALK=0)
  };

#if defined(__CUDA_ARCH__)
  // Warp-collective (all 32 lanes, converged): CTA cta's range of the walk's num_tiles positions. (Not inlined, the
  // kernel spilled more: its call saves registers on the stack.)
  __device__ static Range cta_range(const VarlenBalanceInputs& in, int num_tiles, int cta, int grid) {
    constexpr unsigned kAll = 0xffffffffu;
    const int lane = threadIdx.x % 32;
    const int max_first = chunk_max_first(in, lane, 32);
    int carry = max_first;  // inclusive scan of the maximum, then shifted to exclusive
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(kAll, carry, d);
      if (lane >= d) carry = max(carry, other);
    }
    carry = __shfl_up_sync(kAll, carry, 1);
    if (lane == 0) carry = -1;
    const int64_t own = chunk_cost(in, lane, 32, carry);
    int64_t before = own;  // inclusive scan of the cost, then exclusive
    for (int d = 1; d < 32; d *= 2) {
      const int64_t other = __shfl_up_sync(kAll, before, d);
      if (lane >= d) before += other;
    }
    const int64_t chunks_cost = __shfl_sync(kAll, before, 31);
    before -= own;
    const int g0 = first_block(in, 0);
    const int64_t head_cost = int64_t(g0) + chunks_cost;  // >= num_blocks >= 1
    const int64_t total = head_cost * in.heads;
    auto search = [&](int64_t local) {
      int v = chunk_search(in, lane, 32, carry, before, own, local);
      for (int d = 16; d >= 1; d /= 2) v = min(v, __shfl_xor_sync(kAll, v, d));
      return v;
    };
    Range range;
    range.begin = position_of(in, target_of(total, cta, grid), head_cost, g0, search);
    range.end = cta + 1 >= grid ? num_tiles : position_of(in, target_of(total, cta + 1, grid), head_cost, g0, search);
    range.stride = 1;
    return range;
  }
#endif

  // The same computation on the host with `lanes` simulated lanes (any lanes >= 1 gives the same ranges).
  static Range cta_range_host(const VarlenBalanceInputs& in, int num_tiles, int cta, int grid, int lanes) {
    int carries[64], running = -1;
    int64_t own[64], before[64], chunks_cost = 0;
    for (int l = 0; l < lanes; ++l) {
      carries[l] = running;
      running = max(running, chunk_max_first(in, l, lanes));
    }
    for (int l = 0; l < lanes; ++l) {
      own[l] = chunk_cost(in, l, lanes, carries[l]);
      before[l] = chunks_cost;
      chunks_cost += own[l];
    }
    const int g0 = first_block(in, 0);
    const int64_t head_cost = int64_t(g0) + chunks_cost;
    auto search = [&](int64_t local) {
      int v = in.num_blocks;
      for (int l = 0; l < lanes; ++l) v = min(v, chunk_search(in, l, lanes, carries[l], before[l], own[l], local));
      return v;
    };
    const int64_t total = head_cost * in.heads;
    Range range;
    range.begin = position_of(in, target_of(total, cta, grid), head_cost, g0, search);
    range.end = cta + 1 >= grid ? num_tiles : position_of(in, target_of(total, cta + 1, grid), head_cost, g0, search);
    range.stride = 1;
    return range;
  }
};

}  // namespace flashjax::sm90

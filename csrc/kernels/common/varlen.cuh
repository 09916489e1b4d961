// Packed sequences (varlen, docs/design.md §2.7) as the kernels see them: which sequence a CTA's block belongs to and
// that sequence's rows, with every runtime value clamped.
//
// The grid covers the batch's real blocks, never N x max_seqlen: sequence b's blocks of kBlock rows start at virtual
// block cu_seqlens[b] / kBlock + b, so num_seqs + T / kBlock blocks bound them all (each sequence may straddle one
// more block boundary than its length fills) and only the static shapes size the launch. A CTA finds its sequence by
// binary search over those starts, then its block within it.
//
// cu_seqlens / seqused are device data that nobody checked (under jit they are not concrete). Offsets are clamped into
// [0, T], each end to at least its start and each used length into [0, length]: whatever the arrays hold, a sequence
// is a (possibly empty) row range inside the tensor, so loads and stores predicated by its rows stay in bounds. A
// non-monotone array makes the binary search land on some sequence (it terminates whatever it reads); blocks past
// that sequence's rows have no work. Host and device: the host tests (tests/cpp) run them on host arrays.
#pragma once

#include <cstdint>

namespace flashjax::common {

struct VarlenRows {
  int start = 0;  // first row of the sequence in the packed tensor, in [0, T]
  int length = 0; // rows of its slot, start + length <= T
  int used = 0;   // rows it uses (seqused, or length), in [0, length]
};

__host__ __device__ __forceinline__ int clamp_offset(int32_t value, int total) {
  return min(max(int(value), 0), total);
}

// Sequence b's rows (b in [0, num_seqs)); seqused may be nullptr.
__host__ __device__ __forceinline__ VarlenRows varlen_rows(const int32_t* cu_seqlens, const int32_t* seqused, int b,
                                                  int total) {
  VarlenRows rows;
  rows.start = clamp_offset(cu_seqlens[b], total);
  rows.length = clamp_offset(cu_seqlens[b + 1], total) - rows.start;
  rows.length = max(rows.length, 0);
  rows.used = seqused != nullptr ? min(max(int(seqused[b]), 0), rows.length) : rows.length;
  return rows;
}

// Upper bound of the blocks of kBlock rows over all sequences (host and device): the grid's extent.
__host__ __device__ constexpr int64_t varlen_num_blocks(int total, int num_seqs, int block) {
  return int64_t(total) / block + num_seqs;
}

struct VarlenBlock {
  int seq;    // the sequence holding the block
  int block;  // the block's index within it (may be past its rows: then the CTA has no work)
};

// Sequence b's first virtual block (b in [0, num_seqs)): in [0, varlen_num_blocks) whatever the array holds. The
// backward's workspace places sequences by the same starts (flashjax/workspace.h, kBwdVarlenRowBlock).
template <int kBlock>
__host__ __device__ __forceinline__ int varlen_first_block(const int32_t* cu_seqlens, int b, int total) {
  return clamp_offset(cu_seqlens[b], total) / kBlock + b;
}

// Virtual block v in [0, varlen_num_blocks) -> (sequence, block within it): the last b whose start <= v. Needs
// num_seqs >= 1 (launchers launch nothing for N = 0).
template <int kBlock>
__host__ __device__ __forceinline__ VarlenBlock varlen_block(const int32_t* cu_seqlens, int num_seqs, int total,
                                                             int v) {
  int lo = 0, hi = num_seqs - 1;  // invariant (for monotone starts): start(lo) <= v, and the answer is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (varlen_first_block<kBlock>(cu_seqlens, mid, total) <= v) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, v - varlen_first_block<kBlock>(cu_seqlens, lo, total)};
}

}  // namespace flashjax::common

// The grid a mask mod's bits cover (docs/design.md §2.6-2.7), for dense and packed calls alike.
//
// Dense: the call's own [B, Sq, Sk]. Varlen: the N sequences each padded to max_seqlen_q rows and Wk * 32 keys
// (AttnShape::mask_seqlen_q, mask_words), indices local to the sequence, b the sequence. Seen that way the bits of a
// packed call are those of a dense batch of N, so the tile classifier (kernels/common/mask_bits_tiles.cuh), the
// class lookup and the per-element apply run unchanged on mask_bits_grid(shape); the kernels only index them by the
// sequence and its local rows and keys.
//
// Classifying the padded grid is still right for every sequence: a tile's class is taken over a superset of the
// sequence's valid part of it (all set there => all set on the part; none set => none; else partial, and the kernel
// applies the bits, which are exact per element).
//
// A sequence longer than the grid (a hint too small under jit, or malformed offsets; outside jit Python raises) is
// cut to it by cut_to_mask_grid: its rows past the grid are not computed (out 0, lse -inf, zero gradients, as rows
// that are not there) and its keys past the grid are invisible, the band aligning on the cut lengths. So no class or
// bit outside the buffers is ever read, whatever the offsets hold.
//
// constexpr functions: host code (the FFI handler, the launchers) and device code (the kernels) call the same ones.
#pragma once

#include <cstdint>

#include "flashjax/params.h"

namespace flashjax {

// The keys a bits row covers: Wk whole words (varlen's grid is as wide as its words; bits past max_seqlen_k are 0).
constexpr int32_t mask_grid_keys(int32_t mask_words) { return mask_words * 32; }

// The bits' grid as a dense shape: the shape itself for a dense call; for a packed one, N batch entries of
// mask_seqlen_q x mask_grid_keys(mask_words), with no offsets.
// One copy and per-field selects, no early return of the original: in device code two returned structs made ptxas
// keep the copy in local memory (the sm80 forward's mask twin spilled twice as much).
constexpr AttnShape mask_bits_grid(const AttnShape& s) {
  const bool packed = s.cu_seqlens_q != nullptr;
  AttnShape grid = s;
  grid.batch = packed ? s.num_seqs : s.batch;
  grid.seqlen_q = packed ? s.mask_seqlen_q : s.seqlen_q;
  grid.seqlen_k = packed ? mask_grid_keys(s.mask_words) : s.seqlen_k;
  grid.cu_seqlens_q = grid.cu_seqlens_k = grid.seqused_q = grid.seqused_k = nullptr;
  grid.num_seqs = 0;
  return grid;
}

// A packed sequence's used lengths cut to the grid (a no-op for dense calls and for sequences within their hints).
constexpr void cut_to_mask_grid(const AttnShape& s, int& seqlen_q, int& seqlen_k) {
  if (s.cu_seqlens_q == nullptr) return;
  seqlen_q = seqlen_q < s.mask_seqlen_q ? seqlen_q : s.mask_seqlen_q;
  const int keys = mask_grid_keys(s.mask_words);
  seqlen_k = seqlen_k < keys ? seqlen_k : keys;
}

}  // namespace flashjax

// Packed sequences (varlen, docs/design.md §2.7) in the sm90 backward: which sequence and block a CTA of the main
// kernel (keys) or of the postprocess (query rows) works on, and where that sequence's rows are.
//
// The grids cover the batch's real blocks, never N x max_seqlen (kernels/common/varlen.cuh): the main kernel's
// x is varlen_num_blocks(Tk, N, kBlockN) virtual key blocks per KV head, the postprocess's varlen_num_blocks(Tq, N,
// kBlockM) virtual query blocks per query head; a CTA finds its sequence by binary search over cu_seqlens, so one
// compile serves every packing (only Tq, Tk, N and the heads are shapes).
//
// Every value comes clamped from varlen_rows: a sequence is a (possibly empty) row range inside the packed tensors,
// whatever cu_seqlens / seqused hold. What the kernel derives from it stays in bounds:
//   - TMA boxes start at the sequence's first row plus a block offset inside its used rows, so inside the tensor; a
//     box's rows past the tensor are TMA's zero fill, rows past the used ones (a neighbour's, or padding) are zeroed
//     in shared memory by the MMA warpgroups before any GEMM reads them (BwdMainloopSm90::zero_rows);
//   - dK / dV stores are predicated by the used keys, the postprocess's dQ stores by the used rows;
//   - workspace rows: sequence b's from ws_start = varlen_first_block<kBwdVarlenRowBlock>(b) * kBwdVarlenRowBlock on
//     (flashjax/workspace.h, as the sm80 backward and the shared preprocess place them), its ceil(used / 64) blocks of
//     64 rows end at most (Tq / 64 + N) * 64 <= bwd_varlen_rows(Tq, N) (tests/cpp/test_sm90_bwd_varlen.cu checks it).
// Host and device: the host test runs the walk on host arrays.
#pragma once

#include <climits>
#include <cstdint>

#include "flashjax/params.h"
#include "flashjax/workspace.h"
#include "kernels/common/fast_math.cuh"
#include "kernels/common/varlen.cuh"

namespace flashjax::sm90 {

// One block of one sequence, as a CTA of the varlen backward sees it.
struct BwdVarlenBlock {
  int block;               // within the sequence, in the grid's units (keys: kBlockN, queries: kBlockM)
  int q_start, k_start;    // the sequence's first query row and first key in the packed tensors
  int seqlen_q, seqlen_k;  // its used rows and keys: the band is bottom-right aligned on them (§2.3)
  int q_rows, k_rows;      // rows of the packed tensors from q_start / k_start on (Tq - q_start, Tk - k_start)
  int ws_start;            // its first row in each head's workspace slab, a multiple of kBwdVarlenRowBlock
};

// kBlock rows per block along the side cu_seqlens names: keys (kKeys, the main kernel) or query rows (postprocess).
template <int kBlock, bool kKeys>
struct BwdVarlenSchedulerSm90 {
  // Virtual blocks per head (the grid's x), or 0 where there is no sequence; -1 where that exceeds a grid's int.
  static int64_t num_blocks(const AttnShape& shape) {
    if (shape.num_seqs <= 0) return 0;
    const int64_t blocks = common::varlen_num_blocks(kKeys ? shape.seqlen_k : shape.seqlen_q, shape.num_seqs, kBlock);
    return blocks <= INT_MAX ? blocks : -1;
  }

  // Virtual block v in [0, num_blocks) -> its sequence's rows and the block within it. A block before its
  // sequence's start (non-monotone offsets) or past its used rows has no work (has_work false).
  __host__ __device__ static BwdVarlenBlock block(const AttnShape& shape, int v) {
    const int32_t* cu_seqlens = kKeys ? shape.cu_seqlens_k : shape.cu_seqlens_q;
    const common::VarlenBlock found =
        common::varlen_block<kBlock>(cu_seqlens, shape.num_seqs, kKeys ? shape.seqlen_k : shape.seqlen_q, v);
    const common::VarlenRows q = common::varlen_rows(shape.cu_seqlens_q, shape.seqused_q, found.seq, shape.seqlen_q);
    const common::VarlenRows k = common::varlen_rows(shape.cu_seqlens_k, shape.seqused_k, found.seq, shape.seqlen_k);
    const int used = kKeys ? k.used : q.used;
    BwdVarlenBlock b;
    b.block = found.block >= 0 ? found.block : common::ceil_div(used, kBlock);
    b.q_start = q.start;
    b.k_start = k.start;
    b.seqlen_q = q.used;
    b.seqlen_k = k.used;
    b.q_rows = shape.seqlen_q - q.start;
    b.k_rows = shape.seqlen_k - k.start;
    b.ws_start = common::varlen_first_block<kBwdVarlenRowBlock>(shape.cu_seqlens_q, found.seq, shape.seqlen_q) *
                 kBwdVarlenRowBlock;
    return b;
  }

  __host__ __device__ static bool has_work(const BwdVarlenBlock& b) {
    return int64_t(b.block) * kBlock < (kKeys ? b.seqlen_k : b.seqlen_q);  // then block * kBlock fits an int
  }
};

}  // namespace flashjax::sm90

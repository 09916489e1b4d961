// Sizes of the backward's f32 workspace (BwdParams::dq_accum, dpsum, lse_log2): the one definition that the FFI
// handler checks XLA's buffers against, the C API reports to Python (build info "bwd_seqlen_q_rounding", from
// which primitives.py sizes the buffers it declares) and tests/sanitize allocates by. Likewise the split-keys
// forward's (FwdParams::o_partial, lse_partial).
#pragma once

#include <climits>
#include <cstdint>

namespace flashjax {

// Rows of the per-row workspace are padded to a multiple of this (BwdParams::seqlen_q_rounded). The sm80 backward
// requires it: kernels/sm80/bwd_tile_sizes.cuh's kBwdSeqlenQRounding is the same number.
inline constexpr int32_t kBwdSeqlenQRounding = 128;

struct BwdWorkspaceLayout {
  int32_t seqlen_q_rounded = 0;  // round_up(Sq, kBwdSeqlenQRounding)
  int64_t dq_accum = 0;          // floats: B * Hq * seqlen_q_rounded * D
  int64_t per_row = 0;           // floats in each of dpsum and lse_log2: B * Hq * seqlen_q_rounded
};

constexpr int32_t bwd_seqlen_q_rounded(int32_t seqlen_q) {
  return (seqlen_q + kBwdSeqlenQRounding - 1) / kBwdSeqlenQRounding * kBwdSeqlenQRounding;
}

constexpr BwdWorkspaceLayout bwd_workspace_layout(int32_t batch, int32_t heads_q, int32_t seqlen_q,
                                                  int32_t head_dim) {
  BwdWorkspaceLayout layout;
  layout.seqlen_q_rounded = bwd_seqlen_q_rounded(seqlen_q);
  layout.per_row = int64_t(batch) * heads_q * layout.seqlen_q_rounded;
  layout.dq_accum = layout.per_row * head_dim;
  return layout;
}

// Varlen (docs/design.md §2.7): the workspace is one slab of rows per query head, [Hq, rows, ...], in which sequence b
// takes the rows from (clamp(cu_seqlens_q[b], [0, Tq]) / kBwdVarlenRowBlock + b) * kBwdVarlenRowBlock on
// (kernels/sm80/bwd_tile_scheduler.cuh). Each sequence's padded blocks thus have rows of their own (it straddles at
// most one more unit boundary than its length fills), and Tq + N * kBwdVarlenRowBlock rows bound them all: the
// workspace follows the tokens, never N x max_seqlen, and depends on no tile size. The unit is a multiple of every
// backward M block (the kernels static_assert it), so M blocks stay whole inside a sequence's rows.
inline constexpr int32_t kBwdVarlenRowBlock = 64;
static_assert(kBwdSeqlenQRounding % kBwdVarlenRowBlock == 0);

// Rows of each head's slab: int64, since Tq near 2^31 overflows int32 (the FFI handler refuses more than INT32_MAX).
constexpr int64_t bwd_varlen_rows(int32_t total_q, int32_t num_seqs) {
  const int64_t rows = (int64_t(total_q) / kBwdVarlenRowBlock + num_seqs) * kBwdVarlenRowBlock;
  return (rows + kBwdSeqlenQRounding - 1) / kBwdSeqlenQRounding * kBwdSeqlenQRounding;
}

// dq_accum [Hq, rows, D], dpsum and lse_log2 [Hq, rows]; seqlen_q_rounded = rows (when it fits int32).
constexpr BwdWorkspaceLayout bwd_varlen_workspace_layout(int32_t total_q, int32_t num_seqs, int32_t heads_q,
                                                         int32_t head_dim) {
  BwdWorkspaceLayout layout;
  const int64_t rows = bwd_varlen_rows(total_q, num_seqs);
  layout.seqlen_q_rounded = rows <= INT32_MAX ? static_cast<int32_t>(rows) : 0;
  layout.per_row = int64_t(heads_q) * rows;
  layout.dq_accum = layout.per_row * head_dim;
  return layout;
}

// The deterministic backward's int32 counters (BwdParams::dq_semaphore): one per kBwdDqSemaphoreRows query rows of
// every (batch, query head), [B, Hq, Sq_rounded / kBwdDqSemaphoreRows]; a family's query blocks are a multiple of it.
inline constexpr int32_t kBwdDqSemaphoreRows = 64;
static_assert(kBwdSeqlenQRounding % kBwdDqSemaphoreRows == 0);

constexpr int64_t bwd_dq_semaphores(int32_t batch, int32_t heads_q, int32_t seqlen_q) {
  return int64_t(batch) * heads_q * (bwd_seqlen_q_rounded(seqlen_q) / kBwdDqSemaphoreRows);
}

// The split-keys forward's f32 workspace: a partial O and LSE per part of every query row, [B, num_splits, Hq, Sq, D]
// and [B, num_splits, Hq, Sq] (batch first, so that vmap's folding of a mapped axis into B keeps the layout).
struct FwdSplitWorkspaceLayout {
  int64_t lse_partial = 0;  // floats: B * num_splits * Hq * Sq
  int64_t o_partial = 0;    // floats: lse_partial * D
};

constexpr FwdSplitWorkspaceLayout fwd_split_workspace_layout(int32_t batch, int32_t num_splits, int32_t heads_q,
                                                             int32_t seqlen_q, int32_t head_dim) {
  FwdSplitWorkspaceLayout layout;
  layout.lse_partial = int64_t(batch) * num_splits * heads_q * seqlen_q;
  layout.o_partial = layout.lse_partial * head_dim;
  return layout;
}

// A mask mod's tile classes (AttnShape::mask_tile_classes): one uint8 per tile of the pass's own tiles, [B, Hq,
// ceil(Sq / block_m), ceil(Sk / block_n)], with block_m x block_n the family's tile for that pass (the plan's
// FamilyChoices). Sized for per-(batch, head) bits whatever the mod reads (the plan does not know which; a few KB
// to a few hundred KB), of which the classification writes the [Bm, Hm, ...] corner it needs. The tile of the
// forward is (query rows, keys per step); of the backward (query rows per step, keys per CTA).
// Where the kernel walks block lists (FamilyChoices::mask_block_lists: AttnShape::mask_block_lists), the same
// workspace holds them first at byte 0 (XLA aligns the buffer), then the classes; the uint8 buffer's byte count is
// the two parts' sum:
//   kKeyBlocks (the sm90 forward: per query tile its KV blocks, common/mask_block_lists.cuh): int32 [B, Hq,
//     m_blocks, n_blocks + 2]; the buffer [B, Hq, m_blocks, 4 (n_blocks + 2) + n_blocks];
//   kQueryBlocks (the sm90 backward: per key block its query blocks, common/mask_query_block_lists.cuh): int32 [B,
//     Hq, n_blocks, m_blocks + 2]; the buffer [B, Hq, 4 n_blocks (m_blocks + 2) + m_blocks n_blocks].
enum class MaskBlockLists : uint8_t {
  kNone,        // the kernel reads the classes alone
  kKeyBlocks,   // per (b, h, m-block): the n-blocks its tile visits
  kQueryBlocks  // per (b, h, n-block): the m-blocks its key block visits
};

struct MaskTileClassesLayout {
  int32_t m_blocks = 0;
  int32_t n_blocks = 0;
  MaskBlockLists lists = MaskBlockLists::kNone;
  int64_t list_bytes = 0;  // the lists' bytes (above), 0 with kNone
  int64_t bytes = 0;       // list_bytes + B * Hq * m_blocks * n_blocks
  // The bytes per m-block of a (b, h) (kNone, kKeyBlocks) and per (b, h) (every kind).
  int64_t row_bytes() const {
    return int64_t(n_blocks) + (lists == MaskBlockLists::kKeyBlocks ? 4 * (int64_t(n_blocks) + 2) : 0);
  }
  int64_t head_bytes() const {
    return int64_t(m_blocks) * n_blocks + (lists == MaskBlockLists::kKeyBlocks ? 4 * int64_t(m_blocks) * (n_blocks + 2)
                                           : lists == MaskBlockLists::kQueryBlocks
                                               ? 4 * int64_t(n_blocks) * (m_blocks + 2)
                                               : 0);
  }
  // The parts of a workspace of this layout that starts at `base`: the block lists (nullptr where it has none), then
  // the classes. The FFI handler and the sanitizer driver both split theirs here.
  int32_t* block_lists(uint8_t* base) const { return list_bytes > 0 ? reinterpret_cast<int32_t*>(base) : nullptr; }
  uint8_t* tile_classes(uint8_t* base) const { return base + list_bytes; }
};

constexpr MaskTileClassesLayout mask_tile_classes_layout(int32_t batch, int32_t heads_q, int32_t seqlen_q,
                                                         int32_t seqlen_k, int32_t block_m, int32_t block_n,
                                                         MaskBlockLists lists = MaskBlockLists::kNone) {
  MaskTileClassesLayout layout;
  if (block_m <= 0 || block_n <= 0) return layout;
  layout.m_blocks = (seqlen_q + block_m - 1) / block_m;
  layout.n_blocks = (seqlen_k + block_n - 1) / block_n;
  layout.lists = lists;
  const int64_t heads = int64_t(batch) * heads_q;
  layout.bytes = heads * layout.head_bytes();
  layout.list_bytes = layout.bytes - heads * layout.m_blocks * layout.n_blocks;
  return layout;
}

// The mask bits' words per row (AttnShape::mask_words).
constexpr int32_t mask_bits_words(int32_t seqlen_k) { return (seqlen_k + 31) / 32; }

// The dynamic varlen forward's tile counter (FamilyChoices::varlen_tile_counter): int32 [kVarlenTileCounterInts], of
// which the kernel uses the first; zeroed by the launcher. Calls with a static walk get no workspace at all (the plain
// flashjax_fwd_varlen target, whose binding stays as exported artifacts have it).
inline constexpr int64_t kVarlenTileCounterInts = 1;

}  // namespace flashjax

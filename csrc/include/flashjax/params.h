// The one problem descriptor shared by the FFI layer and every kernel family.
//
// The FFI handlers (csrc/ffi/) decode XLA buffers and attributes into these structs; kernels read nothing
// else. Dimension letters, used everywhere in flashjax:
//   B batch, Sq / Sk query / key sequence lengths, Hq / Hk query / key-value heads, D head dim (the compiled
//   width: the Python layer zero-pads narrower heads, and pads V to the same width as Q/K).
// Layouts are the JAX ones: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D], o [B, Sq, Hq, D], lse [B, Hq, Sq] f32.
// Strides are in elements and 64-bit so that tensors over 2^31 elements index correctly.
#pragma once

#include <cstdint>

namespace flashjax {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1 };

// Fields every pass needs: shapes, strides, the attention semantics (docs/design.md §2).
struct AttnShape {
  int32_t batch = 0;
  int32_t seqlen_q = 0;
  int32_t seqlen_k = 0;
  int32_t heads_q = 0;
  int32_t heads_k = 0;
  int32_t head_dim = 0;  // compiled width (64, 96, 128, 192, 256); also V's width
  DType dtype = DType::kBFloat16;

  // Element strides of q/o ([B, Sq, Hq, D]) and k/v ([B, Sk, Hk, D]); the last dim is contiguous.
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  // lse [B, Hq, Sq]: row stride is 1.
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // Semantics.
  float softmax_scale = 1.f;  // multiplies q·k (1/sqrt(original head dim) by default, set by Python)
  float softcap = 0.f;        // > 0: s = softcap * tanh(s / softcap), applied after scaling
  // Bottom-right aligned band (docs/design.md §2.3): key j visible to query i iff
  //   j <= i + (Sk - Sq) + window_right   (when window_right >= 0)
  //   j >= i + (Sk - Sq) - window_left    (when window_left >= 0)
  // causal=True arrives here as window_right = 0; -1 leaves a side unbounded.
  int32_t window_left = -1;
  int32_t window_right = -1;

  // Varlen (packed sequences, docs/design.md §2.7), on when cu_seqlens_q != nullptr. Then batch is 1, seqlen_q /
  // seqlen_k are the token counts Tq / Tk of q [Tq, Hq, D] and k/v [Tk, Hk, D] (the batch strides unused), lse is
  // [Hq, Tq], and sequence b holds query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key rows likewise, of which
  // it uses the first seqused_*[b] when given. The arrays are device data nobody checked: kernels clamp every offset
  // into [0, T] and every length to >= 0 (varlen_sequence in kernels/common/varlen.cuh), so malformed values give
  // wrong-but-finite rows and never an out-of-bounds access.
  const int32_t* cu_seqlens_q = nullptr;  // [num_seqs + 1]
  const int32_t* cu_seqlens_k = nullptr;  // [num_seqs + 1]
  const int32_t* seqused_q = nullptr;     // optional [num_seqs]
  const int32_t* seqused_k = nullptr;     // optional [num_seqs]
  int32_t num_seqs = 0;  // N

  // Mask mod (docs/design.md §2.6, issue 38), on when mask_bits != nullptr (dense; varlen below): the mod's predicate
  // evaluated once over every (b, h, q, kv) into a packed bitmask, uint32 [Bm, Hm, Sq, Wk] row-major, Wk =
  // ceil(Sk / 32); bit j (1u << j) of word [b, h, q, w] is 1 iff mod(b, h, q, 32 w + j), raw top-left indices, h the
  // QUERY head; bits for kv >= Sk are 0. Bm is B when the mod reads b, else 1 (batch stride 0), Hm likewise Hq or 1
  // (head stride 0). Strides count words; a row is mask_words (= Wk) words. The kernels AND it with the band.
  const uint32_t* mask_bits = nullptr;
  int64_t mask_batch_stride = 0;  // Hm * Sq * Wk, or 0 when the bits broadcast over the batch (Bm = 1)
  int64_t mask_head_stride = 0;   // Sq * Wk, or 0 when they broadcast over the heads (Hm = 1)
  int32_t mask_words = 0;         // Wk
  // Varlen with a mask mod: the bits cover N sequences padded to max_seqlen_q rows and Wk * 32 keys, [Bm, Hm,
  // mask_seqlen_q, Wk] with Bm N or 1, indices local to each sequence and b the sequence
  // (kernels/common/mask_bits_grid.cuh). Unused by dense calls, whose bits have Sq rows. It fills the padding after
  // mask_words, so the fields after it keep their offsets.
  int32_t mask_seqlen_q = 0;
  // The pass's tile classes (workspace, flashjax/workspace.h's mask_tile_classes_layout): one byte per (b, h,
  // m-block, n-block) of the family's tiles for this pass, written by kernels/common/mask_bits_tiles.cuh before the
  // attention kernel; b / h collapse to 0 where the bits broadcast, as above.
  uint8_t* mask_tile_classes = nullptr;
  // The pass's block lists, where its kernel walks them (FamilyChoices::mask_block_lists; the same workspace, ahead of
  // the classes): per (b, h, m-block) the n-blocks its tile visits, int32 [Bm, Hm, m_blocks, n_blocks + 2], written
  // by kernels/common/mask_block_lists.cuh from the classes and the band. nullptr for the kernels that read classes.
  int32_t* mask_block_lists = nullptr;
};

// Forward: (q, k, v[, sinks]) -> (o, lse).
struct FwdParams : AttnShape {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* sinks = nullptr;  // optional [Hq] logits joining each row's denominator
  void* o = nullptr;
  float* lse = nullptr;  // natural-log LSE including the sink term; -inf for an empty row without sinks
  // Split keys (sm90 only, csrc/kernels/sm90/fwd_split_kv.h): num_splits > 1 asks for that many parts per tile, with
  // the f32 workspace the plan sized by fwd_split_workspace_layout (flashjax/workspace.h). A family that does
  // not split ignores them.
  int32_t num_splits = 1;
  float* o_partial = nullptr;    // [B, num_splits, Hq, Sq, D]
  float* lse_partial = nullptr;  // [B, num_splits, Hq, Sq]
  // The plan's choices (flashjax/choices.h, csrc/ffi/plan.h) that the family's launcher follows: its tile
  // configuration (the family's own index) and the query heads sharing one tile (GQA packing; 1: none). Last in the
  // struct, so that the fields kernels read keep their offsets.
  int32_t tile_class = 0;
  int32_t pack_group = 1;
  // Varlen on the sm90 forward with FLASHJAX_SM90_VARLEN_WALK=2 (the plan's tile_counter workspace, target
  // flashjax_fwd_varlen_dynamic): one int32 the kernel hands tiles out from, zeroed by the launcher before each launch.
  // nullptr: the walk is static (what the setting asks for otherwise, round robin where it asked for 2).
  int32_t* varlen_tile_counter = nullptr;
};

// Backward: (q, k, v, o, lse, do, dlse[, sinks]) -> (dq, dk, dv[, dsinks]).
// Workspace buffers are outputs allocated by XLA and sized by Python (bwd_workspace_layout in
// csrc/include/flashjax/workspace.h is the single definition of their sizes); kernels zero what they
// accumulate into, so their initial contents are irrelevant.
struct BwdParams : AttnShape {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const float* lse = nullptr;    // [B, Hq, Sq], as the forward wrote it
  const void* dout = nullptr;    // same layout as o
  const float* dlse = nullptr;   // optional cotangent of lse, [B, Hq, Sq]; nullptr = zero
  const float* sinks = nullptr;  // optional [Hq]
  void* dq = nullptr;            // same layout as q
  void* dk = nullptr;            // same layout as k
  void* dv = nullptr;            // same layout as v
  float* dsinks = nullptr;       // [Hq] when sinks != nullptr
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // Workspace (f32): dq accumulator of B * Hq * Sq_rounded * D floats (the order inside it is the backward
  // kernel's own: sm80 lays each 64-row block out in MMA-fragment order so atomics cover whole cache lines);
  // per-row D' = rowsum(dO∘O) - dlse and the LSE in log2 units, both [B, Hq, Sq_rounded].
  // Sq_rounded = round_up(Sq, 128).
  float* dq_accum = nullptr;
  float* dpsum = nullptr;
  float* lse_log2 = nullptr;
  int32_t seqlen_q_rounded = 0;

  // deterministic=True (a family whose table row says it can): every query block's dQ partials are added in one
  // fixed order of the KV blocks, and dsinks is summed in a fixed order, so gradients are bitwise reproducible.
  // dq_semaphore: bwd_dq_semaphores (flashjax/workspace.h) counters, zeroed by the launcher, one per 64-row
  // query block of every (batch, query head). A family that cannot order its accumulation refuses the call.
  bool deterministic = false;
  int32_t* dq_semaphore = nullptr;
};

// Tangent (forward-mode derivative, issue 39): (q, k, v, o, lse, tq, tk, tv[, sinks, tsinks]) -> (t_out, t_lse),
// linear in the tangents (tq, tk, tv, tsinks). o and lse are the forward's outputs for these very inputs (the kernel
// recomputes P = exp(s - lse) from them, docs/design.md §3.6). Each tangent has its primal's layout and strides: tq
// and t_out q's / o's, tk and tv k's / v's, t_lse lse's. No workspace.
struct TangentParams : AttnShape {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const float* lse = nullptr;      // [B, Hq, Sq], as the forward wrote it (sink term included)
  const float* sinks = nullptr;    // optional [Hq]; tsinks is given exactly when sinks is
  const void* tq = nullptr;
  const void* tk = nullptr;
  const void* tv = nullptr;
  const float* tsinks = nullptr;   // [Hq]
  void* t_out = nullptr;           // o's layout
  float* t_lse = nullptr;          // lse's layout
};

// Fused jvp (issue 39): (q, k, v, tq, tk, tv[, sinks, tsinks]) -> (o, lse, t_out, t_lse), the forward and its tangent
// in one pass (S computed once; docs/design.md §3.7). o and lse are exactly the forward's (FwdParams), t_out and
// t_lse the tangent's (TangentParams): each tangent has its primal's layout and strides. No workspace.
struct JvpParams : AttnShape {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* sinks = nullptr;    // optional [Hq]; tsinks is given exactly when sinks is
  const void* tq = nullptr;
  const void* tk = nullptr;
  const void* tv = nullptr;
  const float* tsinks = nullptr;   // [Hq]
  void* o = nullptr;
  float* lse = nullptr;            // [B, Hq, Sq]
  void* t_out = nullptr;           // o's layout
  float* t_lse = nullptr;          // lse's layout
};

}  // namespace flashjax

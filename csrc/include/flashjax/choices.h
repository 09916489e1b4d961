// What a kernel family decides for one call beyond which kernel runs it: the tile configuration, GQA packing and
// key splits, each with its reason. Each family reports them through its launch.h (fwd_choices / bwd_choices, one
// instantiation per kernel, listed in the kernel table); the plan (csrc/ffi/plan.h) puts them into the call's plan;
// the FFI handler writes the decisions into FwdParams (tile_class, pack_group, num_splits), and the family's launcher
// follows them without deciding anything again.
#pragma once

#include <cstdint>
#include <string>

#include "flashjax/params.h"
#include "flashjax/workspace.h"

namespace flashjax {

struct FamilyChoices {
  int32_t tile_class = 0;  // the family's own index of its tile configuration (FwdParams::tile_class)
  int32_t block_m = 0;     // query rows per tile
  int32_t block_n = 0;     // keys per mainloop step
  int32_t pack_group = 1;  // query heads sharing one tile (GQA packing); 1: no packing
  int32_t num_splits = 1;  // parts each tile's keys run as on separate CTAs (split keys); 1: no split
  // Which block lists a mask mod's kernel walks (kKeyBlocks: kernels/common/mask_block_lists.cuh; kQueryBlocks:
  // mask_query_block_lists.cuh), which the pass's mask workspace then holds ahead of the tile classes
  // (flashjax/workspace.h); kNone: it reads the classes alone.
  MaskBlockLists mask_block_lists = MaskBlockLists::kNone;
  // A varlen forward hands its tiles out at run time (sm90, FLASHJAX_SM90_VARLEN_WALK=2): the pass's workspace is
  // then one int32 counter (flashjax/workspace.h), the FFI target flashjax_fwd_varlen_dynamic.
  bool varlen_tile_counter = false;
  // Why, in words (filled only when the plan is asked to explain itself).
  std::string tile_reason;
  std::string packing_reason;
  std::string split_reason;
};

// What a family's choice function sees besides the call (its AttnShape, at the compiled head width).
struct ChoiceQuery {
  int32_t num_sms = 0;     // SMs of the device the call is planned for; 0 when unknown (then nothing splits by rule)
  int32_t num_splits = 0;  // 0: choose; n >= 1: the count the lowering fixed (XLA sized the workspace for it)
  bool explain = false;    // fill the reasons
  // Packed sequences (the plan's AttnShape carries no offsets: Problem::varlen); a family may also see them in the
  // shape's cu_seqlens_q where its caller has the call's own params.
  bool varlen = false;
  bool mask_mod = false;  // the call has a mask mod (Problem::mask_mod; the plan's AttnShape carries no bits)
};

using ChoiceFn = FamilyChoices (*)(const AttnShape& shape, const ChoiceQuery& query);

}  // namespace flashjax

// The sm90 forward's per-call choices (flashjax/choices.h): key splitting (fwd_split_kv.h), GQA packing
// (fwd_pack_gqa.h) and the tile configuration by how many keys the rows see (FwdKeyLoad, fwd_tile_sizes.cuh). The
// plan asks them through launch.h's fwd_choices; run_fwd follows what the plan wrote into FwdParams.
#pragma once

#include <string>

#include "flashjax/choices.h"
#include "flashjax/params.h"
#include "flashjax/settings.h"
#include "kernels/common/band_mask.cuh"
#include "kernels/sm90/fwd_pack_gqa.h"
#include "kernels/sm90/fwd_split_kv.h"
#include "kernels/sm90/fwd_tile_sizes.cuh"

namespace flashjax::sm90 {

// The call's FwdKeyLoad: kMany = more than one 128-row tile of queries, and either no band or a band whose middle
// query row sees at least 2048 keys (about the mean over the rows for causal and sliding-window bands), and of those
// kManyShortRows = no band and at most 512 keys; kFewShortBand = more than one tile and a band whose middle row sees
// fewer than 512 keys. The normalized band drops a side that excludes nothing, so e.g. a window wider than the
// sequence counts as no band.
inline FwdKeyLoad key_load(const AttnShape& shape) {
  if (shape.seqlen_q <= 128) return FwdKeyLoad::kFew;
  const common::BandMask band(shape.seqlen_q, shape.seqlen_k, shape.window_left, shape.window_right);
  if (band.left < 0 && band.right < 0) return shape.seqlen_k <= 512 ? FwdKeyLoad::kManyShortRows : FwdKeyLoad::kMany;
  const int middle_row = shape.seqlen_q / 2;
  const int middle_keys = band.col_end(middle_row) - band.col_begin(middle_row);
  return middle_keys >= 2048 ? FwdKeyLoad::kMany : middle_keys >= 512 ? FwdKeyLoad::kFew : FwdKeyLoad::kFewShortBand;
}

inline const char* key_load_name(FwdKeyLoad load) {
  switch (load) {
    case FwdKeyLoad::kFewShortBand:
      return "a short band: the middle row sees fewer than 512 keys";
    case FwdKeyLoad::kFew:
      return "few keys per row: one tile of queries, or a band whose middle row sees fewer than 2048 keys";
    case FwdKeyLoad::kManyShortRows:
      return "no band and at most 512 keys";
    default:
      return "many keys per row";
  }
}

// Packed sequences run the varlen kernel (fwd_launch.cuh's FwdVarlenKernel): kFew's tiles, keys not split. The key
// load of a varlen call is not known on the host (the lengths are device data; the token counts say nothing about
// them), and kFew's tiles are the ones made for short rows, which most packed sequences have. GQA is packed by the
// dense rule (fwd_pack_group) applied to the mean query length ceil(Tq / N), static shapes only: decode (one query
// per sequence) and other short query sequences pack, so that a group's query heads share each tile and read its K/V
// once; long ones do not (the rule keeps their unpacked tiles). Splitting keys would need the virtual-block walk per
// part; not done.
inline FamilyChoices varlen_fwd_choices(int head_dim, const AttnShape& shape, const ChoiceQuery& query) {
  FamilyChoices choices;
  const FwdTileSizes tiles = fwd_tile_sizes(head_dim, FwdKeyLoad::kFew);
  const int num_seqs = shape.num_seqs > 0 ? shape.num_seqs : shape.batch;
  const int mean_seqlen_q = num_seqs > 0 ? static_cast<int>((int64_t(shape.seqlen_q) + num_seqs - 1) / num_seqs) : 0;
  choices.pack_group = fwd_pack_group(mean_seqlen_q, shape.heads_q, shape.heads_k, pack_gqa_mode());
  choices.tile_class = static_cast<int32_t>(FwdKeyLoad::kFew);
  choices.block_m = tiles.block_m;
  choices.block_n = tiles.block_n;
  // FLASHJAX_SM90_VARLEN_WALK=2 (the default): tiles handed out at run time from a counter the call's workspace
  // holds (fwd_varlen_ring.cuh).
  choices.varlen_tile_counter = setting_int(Setting::kSm90VarlenWalk, 2) == 2;
  if (!query.explain) return choices;
  choices.tile_reason = std::to_string(tiles.block_m) + " x " + std::to_string(tiles.block_n) +
                        " tiles (the varlen kernel's: one tile per (sequence block, query head or GQA group), the "
                        "sequences' lengths being device data" +
                        (choices.varlen_tile_counter ? "; handed out at run time from a counter)" : ")");
  if (choices.pack_group > 1) {
    choices.packing_reason = "the " + std::to_string(choices.pack_group) +
                             " query heads of a KV head share each varlen tile (mean query length " +
                             std::to_string(mean_seqlen_q) + ")";
  } else if (shape.heads_k > 0 && shape.heads_q > shape.heads_k) {
    choices.packing_reason = pack_gqa_mode() == PackGqaMode::kNever
                                 ? "unpacked: FLASHJAX_SM90_PACK_GQA=0"
                                 : "unpacked: at the mean query length packing would remove fewer than a quarter of "
                                   "the 128-row tiles";
  }
  choices.split_reason = "not split: the varlen kernel does not split keys";
  return choices;
}

// A mask mod's tiles (issue 38): one configuration per head dim, whose n-blocks are whole 32-key words of the bits
// (kernels/common/mask_bits.cuh reads a block's words from its first): 128 x 128 up to D 128 (kFew's), 128 x 64
// above (kManyShortRows'; the key-load classes' 112, 80 and 48 keys per step would straddle words). Keys are not
// split and GQA not packed: a packed tile would hold rows of several heads, whose bits differ for per-head mods.
constexpr FwdKeyLoad mask_mod_key_load(int head_dim) {
  return head_dim <= 128 ? FwdKeyLoad::kFew : FwdKeyLoad::kManyShortRows;
}

inline FamilyChoices mask_mod_fwd_choices(int head_dim, const AttnShape& shape, const ChoiceQuery& query) {
  FamilyChoices choices;
  const FwdKeyLoad load = mask_mod_key_load(head_dim);
  const FwdTileSizes tiles = fwd_tile_sizes(head_dim, load);
  choices.tile_class = static_cast<int32_t>(load);
  choices.block_m = tiles.block_m;
  choices.block_n = tiles.block_n;
  choices.mask_block_lists = MaskBlockLists::kKeyBlocks;
  if (!query.explain) return choices;
  choices.tile_reason = std::to_string(tiles.block_m) + " x " + std::to_string(tiles.block_n) +
                        " tiles (the mask-mod kernel's: each tile walks its list of KV blocks, the mod's empty tiles "
                        "left out, its full ones run without a mask)";
  if (shape.heads_k > 0 && shape.heads_q > shape.heads_k) {
    choices.packing_reason = "unpacked: the mask-mod kernel's tiles hold one query head's rows";
  }
  choices.split_reason = "not split: the mask-mod kernel does not split keys";
  return choices;
}

inline FamilyChoices fwd_choices_for(int head_dim, const AttnShape& shape, const ChoiceQuery& query) {
  if (query.mask_mod || shape.mask_bits != nullptr) return mask_mod_fwd_choices(head_dim, shape, query);
  if (query.varlen || shape.cu_seqlens_q != nullptr) return varlen_fwd_choices(head_dim, shape, query);
  FamilyChoices choices;
  const int group = shape.heads_k > 0 ? shape.heads_q / shape.heads_k : 1;
  choices.num_splits = query.num_splits >= 1
                           ? query.num_splits
                           : fwd_num_splits(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads_q,
                                            shape.heads_k, head_dim, shape.window_left, query.num_sms,
                                            split_kv_mode());
  // The split kernel packs every GQA call; otherwise the packing rule decides.
  choices.pack_group = choices.num_splits > 1
                           ? group
                           : fwd_pack_group(shape.seqlen_q, shape.heads_q, shape.heads_k, pack_gqa_mode());
  // Packed and split calls take kFew's tiles (their query sequences are short); the others the key load's.
  const FwdKeyLoad load =
      choices.num_splits > 1 || choices.pack_group > 1 ? FwdKeyLoad::kFew : key_load(shape);
  const FwdTileSizes tiles = fwd_tile_sizes(head_dim, load);
  choices.tile_class = static_cast<int32_t>(load);
  choices.block_m = tiles.block_m;
  choices.block_n = tiles.block_n;
  if (!query.explain) return choices;
  choices.tile_reason = std::to_string(tiles.block_m) + " x " + std::to_string(tiles.block_n) + " tiles (" +
                        (choices.num_splits > 1   ? "the split kernel's"
                         : choices.pack_group > 1 ? "the packed kernel's"
                                                  : key_load_name(load)) +
                        ")";
  if (choices.pack_group > 1) {
    choices.packing_reason = "the " + std::to_string(group) + " query heads of a KV head share each forward tile";
  } else if (group > 1) {
    choices.packing_reason = pack_gqa_mode() == PackGqaMode::kNever
                                 ? "unpacked: FLASHJAX_SM90_PACK_GQA=0"
                                 : "unpacked: packing would remove fewer than a quarter of the 128-row tiles";
  }
  if (choices.num_splits > 1) {
    choices.split_reason = "each forward tile's keys run as " + std::to_string(choices.num_splits) +
                           " parts on separate CTAs, merged by a second kernel";
  } else {
    choices.split_reason = split_kv_mode() == 0 ? "not split: FLASHJAX_SM90_SPLIT_KV=0"
                           : query.num_sms <= 0 ? "not split: the device's SM count is unknown"
                                                : "not split: the tiles fill more than half of the SMs, or the "
                                                  "rows see fewer than 8 key blocks";
  }
  return choices;
}

}  // namespace flashjax::sm90

// When the sm90 forward splits keys: a call with too few query tiles to fill the GPU (decode of a few sequences
// against a long cache: one tile per KV head) runs each tile's KV range as num_splits parts on separate CTAs, each
// writing a partial O (f32, normalized by its own sum) and its LSE to a workspace; a second kernel combines the parts
// (fwd_split_combine.cuh). Plain C++ (no CUDA): the rule the family's plan applies (fwd_choices.cuh) when a call is
// lowered, since XLA allocates the parts' workspace then; the handler's plan and the launcher take the count as given.
#pragma once

#include <algorithm>
#include <cstdint>

#include "flashjax/settings.h"
#include "kernels/sm90/fwd_pack_gqa.h"
#include "kernels/sm90/fwd_tile_sizes.cuh"

namespace flashjax::sm90 {

// Most parts per tile: the workspace holds num_splits partial rows of every query row, and the combine reads them all.
constexpr int kMaxKvSplits = 64;
// Fewest KV blocks per part: a part pays a tile's fixed path (Q load, first block, epilogue) like a whole tile.
constexpr int kMinBlocksPerSplit = 4;

// FLASHJAX_SM90_SPLIT_KV (flashjax/settings.h): unset or "auto" splits where the rule below says so, "0" never,
// n > 1 splits every call into n parts (at most kMaxKvSplits; tests force the path with it).
inline int split_kv_mode() {
  const int value = setting_int(Setting::kSm90SplitKv, -1);
  return value < 0 ? -1 : std::min(value, kMaxKvSplits);
}

// Parts per tile for a call on a GPU of num_sms SMs: 1 (no split) unless the call's tiles fill at most half of the
// SMs and its rows see at least 2 x kMinBlocksPerSplit KV blocks; then as many parts as fit the SMs in one round,
// at least kMinBlocksPerSplit blocks each. The split kernel packs GQA (its tiles are kFew's, one per KV head and 128
// packed rows) and has a capped twin, so softcap does not matter. mode: split_kv_mode().
inline int fwd_num_splits(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_k, int head_dim,
                          int window_left, int num_sms, int mode) {
  if (mode == 0 || batch <= 0 || seqlen_q <= 0 || seqlen_k <= 0 || heads_k <= 0 ||
      heads_q % heads_k != 0) {
    return 1;
  }
  if (mode > 0) return mode;
  if (num_sms <= 0) return 1;
  constexpr int64_t kRows = 128;
  const int64_t chunks = int64_t(heads_q / heads_k) * ((seqlen_q + kPackedChunkRows - 1) / kPackedChunkRows);
  const int64_t tiles = int64_t(batch) * heads_k * ((chunks * kPackedChunkRows + kRows - 1) / kRows);
  if (2 * tiles > num_sms) return 1;
  // Keys a tile's rows see at most: all of them, or a left window's width past the tile's last row.
  const int64_t keys = window_left < 0 ? seqlen_k : std::min<int64_t>(seqlen_k, int64_t(window_left) + kRows);
  const int block_n = fwd_tile_sizes(head_dim, FwdKeyLoad::kFew).block_n;
  const int64_t blocks = (keys + block_n - 1) / block_n;
  const int64_t splits = std::min<int64_t>({num_sms / tiles, blocks / kMinBlocksPerSplit, kMaxKvSplits});
  return splits >= 2 ? static_cast<int>(splits) : 1;
}

}  // namespace flashjax::sm90

// When the sm90 forward packs GQA: the query heads of one KV head share a tile (fwd_query_tiling.cuh). Plain C++ (no
// CUDA): the rule the family's plan applies (fwd_choices.cuh), which the launcher then follows.
#pragma once

#include <cstdint>

#include "flashjax/settings.h"

namespace flashjax::sm90 {

// FLASHJAX_SM90_PACK_GQA (flashjax/settings.h): unset or "auto" packs where the rule below says so, "0" never, any
// other number every GQA call (tests force both paths through every configuration with it).
enum class PackGqaMode { kAuto, kNever, kAlways };

inline PackGqaMode pack_gqa_mode() {
  const int value = setting_int(Setting::kSm90PackGqa, -1);
  return value < 0 ? PackGqaMode::kAuto : value == 0 ? PackGqaMode::kNever : PackGqaMode::kAlways;
}

// Rows of a packed tile come in chunks of this many consecutive positions of one query head (8: one swizzle atom of
// the Q and O tiles in shared memory, so each chunk is a TMA box of its own).
constexpr int kPackedChunkRows = 8;

// Query heads per tile for a call: G = Hq / Hk when packed, 1 when not. Auto packs where that removes at least a
// quarter of the 128-row tiles: a tile of one head over Sq < 128 positions is mostly zero-filled rows (decode,
// speculative decoding, chunked prefill), while G heads of the same positions fill it and read their K/V once.
// Below that saving the unpacked kernels are kept: their tile sizes follow the key load (packed calls take kFew's,
// e.g. 128 rows where D 64 would take 192), they need one TMA box per 64 rows rather than one per 8 positions, and
// fewer tiles pay only where they also mean fewer rounds of tiles over the SMs. Measured on the H200
// (docs/performance.md): 4 of 16 tiles saved, +78% (Sq 64, G 4, 256 tiles against 128 on 132 SMs); 3 of 16, -6%
// (Sq 200, G 8: two rounds either way); long sequences with a nearly full last tile (Sq 4000), -1 to -3% forced packed.
inline int fwd_pack_group(int seqlen_q, int heads_q, int heads_k, PackGqaMode mode) {
  if (heads_k <= 0 || heads_q % heads_k != 0 || seqlen_q <= 0) return 1;
  const int group = heads_q / heads_k;
  if (group <= 1 || mode == PackGqaMode::kNever) return 1;
  if (mode == PackGqaMode::kAlways) return group;
  constexpr int64_t kRows = 128;
  const int64_t unpacked_tiles = group * ((seqlen_q + kRows - 1) / kRows);
  const int64_t chunks = group * int64_t((seqlen_q + kPackedChunkRows - 1) / kPackedChunkRows);
  const int64_t packed_tiles = (chunks * kPackedChunkRows + kRows - 1) / kRows;
  return 4 * packed_tiles <= 3 * unpacked_tiles ? group : 1;
}

}  // namespace flashjax::sm90

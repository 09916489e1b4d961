// The sm90 backward's varlen variant (csrc/kernels/sm90/bwd_varlen_scheduler.cuh, BwdMainloopSm90<..., kVarlen>) on
// the host:
//   1. the walk: whatever the offsets hold, every CTA's boxes start inside the packed tensors, its dK / dV stores
//      and the postprocess's dQ stores stay inside them, its workspace rows inside the slab of bwd_varlen_rows, and
//      the rows the MMA warpgroups zero lie inside the box; where the offsets are well formed, every used key gets
//      its dK / dV from exactly one CTA, every used query row its dQ from exactly one postprocess CTA, no unused row
//      is written, and the sequences' workspace rows are disjoint;
//   2. zero_rows, which zeroes the rows of a box past a sequence's used rows / keys, against an independent model
//      of where TMA and wgmma put element (row, d) (the hardware swizzle on byte addresses: bits [4, 4 + B) XOR bits
//      [7, 7 + B)), for the Q / dO stages and the K and V tiles at every head dim (the forward's V-row bug was
//      addressing through the layout's function instead: tests/cpp/test_sm90_varlen_v_rows.cu).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "flashjax/workspace.h"
#include "kernels/common/bwd_band_mask.cuh"
#include "kernels/sm90/bwd_mainloop.cuh"
#include "kernels/sm90/bwd_varlen_scheduler.cuh"

namespace flashjax::sm90 {
namespace {

struct Packing {
  std::vector<int32_t> cu_q, cu_k, used_q, used_k;  // used: empty for none
  int total_q, total_k;
  bool well_formed;
};

struct Band {
  int left, right;
};

template <int kBlockN, int kBlockM = 64>
void check_walk(const Packing& p, int heads_q, int heads_k, Band band) {
  SCOPED_TRACE(::testing::Message() << "kBlockN " << kBlockN << " window (" << band.left << ", " << band.right << ")");
  using Keys = BwdVarlenSchedulerSm90<kBlockN, /*kKeys=*/true>;
  using Queries = BwdVarlenSchedulerSm90<kBlockM, /*kKeys=*/false>;
  AttnShape shape{};
  shape.batch = 1;
  shape.heads_q = heads_q;
  shape.heads_k = heads_k;
  shape.seqlen_q = p.total_q;
  shape.seqlen_k = p.total_k;
  shape.num_seqs = static_cast<int>(p.cu_q.size()) - 1;
  shape.cu_seqlens_q = p.cu_q.data();
  shape.cu_seqlens_k = p.cu_k.data();
  shape.seqused_q = p.used_q.empty() ? nullptr : p.used_q.data();
  shape.seqused_k = p.used_k.empty() ? nullptr : p.used_k.data();
  const int64_t slab_rows = bwd_varlen_rows(p.total_q, shape.num_seqs);

  // The grids: Tk / kBlockN + N and Tq / kBlockM + N virtual blocks per head, never N x max_seqlen.
  const int64_t key_blocks = Keys::num_blocks(shape);
  const int64_t query_blocks = Queries::num_blocks(shape);
  ASSERT_EQ(key_blocks, shape.num_seqs > 0 ? p.total_k / kBlockN + shape.num_seqs : 0);
  ASSERT_EQ(query_blocks, shape.num_seqs > 0 ? p.total_q / kBlockM + shape.num_seqs : 0);

  std::vector<int> key_writes(p.total_k, 0);
  std::vector<int> slab_owner(slab_rows, -1);  // well formed: the sequence whose steps use the slab row
  for (int v = 0; v < key_blocks; ++v) {
    const BwdVarlenBlock b = Keys::block(shape, v);
    ASSERT_TRUE(b.q_start >= 0 && b.q_start <= p.total_q && b.q_rows == p.total_q - b.q_start);
    ASSERT_TRUE(b.k_start >= 0 && b.k_start <= p.total_k && b.k_rows == p.total_k - b.k_start);
    ASSERT_TRUE(b.seqlen_q >= 0 && b.seqlen_q <= b.q_rows && b.seqlen_k >= 0 && b.seqlen_k <= b.k_rows);
    ASSERT_EQ(b.ws_start % kBwdVarlenRowBlock, 0);
    ASSERT_GE(b.block, 0);
    if (!Keys::has_work(b)) continue;
    const int n_start = b.block * kBlockN;
    ASSERT_LT(b.k_start + n_start, p.total_k) << "the K / V box starts past the tensor";
    // The rows zeroed in the box (mma's first step): past the used keys, inside the tensor, inside the box.
    const int past_begin = b.seqlen_k - n_start;
    const int past_end = std::min(kBlockN, b.k_rows - n_start);
    ASSERT_GT(past_begin, 0);
    ASSERT_LE(past_end, kBlockN);
    // dK / dV: the keys of the block below the used ones (bwd_store_dkdv_varlen_sm90).
    for (int key = n_start; key < std::min(n_start + kBlockN, b.seqlen_k); ++key) ++key_writes[b.k_start + key];
    // The steps: query blocks of the band (the same for every head of the group).
    const common::BwdBandMask mask(b.seqlen_q, b.seqlen_k, band.left, band.right);
    const common::MBlockRange m_blocks = mask.m_blocks<kBlockM, kBlockN>(n_start);
    for (int m_block = m_blocks.begin; m_block < m_blocks.end; ++m_block) {
      const int m_start = m_block * kBlockM;
      ASSERT_GE(m_start, 0);
      ASSERT_LT(m_start, b.seqlen_q) << "a step without used rows";
      ASSERT_LT(b.q_start + m_start, p.total_q) << "the Q / dO box starts past the tensor";
      const int q_past_begin = b.seqlen_q - m_start;
      const int q_past_end = std::min(kBlockM, b.q_rows - m_start);
      ASSERT_GT(q_past_begin, 0);
      ASSERT_LE(q_past_end, kBlockM);
      // LSE / D' / dQ rows of every query head: [ws_start + m_start, + kBlockM) of the head's slab.
      const int64_t first = int64_t(b.ws_start) + m_start;
      ASSERT_GE(first, 0);
      ASSERT_LE(first + kBlockM, slab_rows) << "workspace rows past the slab";
      const int seq = common::varlen_block<kBlockN>(p.cu_k.data(), shape.num_seqs, p.total_k, v).seq;
      for (int64_t r = first; r < first + kBlockM; ++r) {
        if (p.well_formed) {
          ASSERT_TRUE(slab_owner[r] == -1 || slab_owner[r] == seq) << "sequences share workspace row " << r;
        }
        slab_owner[r] = seq;
      }
    }
  }

  std::vector<int> dq_writes(p.total_q, 0);
  for (int v = 0; v < query_blocks; ++v) {
    const BwdVarlenBlock b = Queries::block(shape, v);
    ASSERT_TRUE(b.q_start >= 0 && b.q_start + b.seqlen_q <= p.total_q && b.seqlen_q >= 0);
    ASSERT_GE(b.block, 0);
    if (!Queries::has_work(b)) continue;
    const int m_start = b.block * kBlockM;
    const int64_t first = int64_t(b.ws_start) + m_start;
    ASSERT_TRUE(first >= 0 && first + kBlockM <= slab_rows) << "postprocess reads past the slab";
    const int seq = common::varlen_block<kBlockM>(p.cu_q.data(), shape.num_seqs, p.total_q, v).seq;
    for (int r = m_start; r < std::min(m_start + kBlockM, b.seqlen_q); ++r) {
      ++dq_writes[b.q_start + r];
      // The rows the main kernel added into for this sequence are the ones read back here.
      if (p.well_formed && slab_owner[first + r - m_start] != -1) {
        ASSERT_EQ(slab_owner[first + r - m_start], seq) << "postprocess reads another sequence's row";
      }
    }
  }

  if (!p.well_formed) return;
  // Well formed: exactly the used rows and keys, once each.
  std::vector<bool> used_q(p.total_q, false), used_k(p.total_k, false);
  for (size_t b = 0; b + 1 < p.cu_q.size(); ++b) {
    const int uq = p.used_q.empty() ? p.cu_q[b + 1] - p.cu_q[b] : p.used_q[b];
    const int uk = p.used_k.empty() ? p.cu_k[b + 1] - p.cu_k[b] : p.used_k[b];
    for (int t = p.cu_q[b]; t < p.cu_q[b] + uq; ++t) used_q[t] = true;
    for (int t = p.cu_k[b]; t < p.cu_k[b] + uk; ++t) used_k[t] = true;
  }
  for (int t = 0; t < p.total_k; ++t) EXPECT_EQ(key_writes[t], used_k[t] ? 1 : 0) << "key " << t;
  for (int t = 0; t < p.total_q; ++t) EXPECT_EQ(dq_writes[t], used_q[t] ? 1 : 0) << "query row " << t;
}

const std::vector<Packing>& packings() {
  constexpr int32_t kMax = INT32_MAX;
  static const std::vector<Packing> all = {
      // Lengths around the 64-row query blocks and the 64 / 128-key blocks, packed differently, an empty sequence,
      // padding past cu_seqlens[N].
      {{0, 63, 127, 192, 192, 320, 449}, {0, 129, 257, 322, 322, 386, 449}, {}, {}, 460, 470, true},
      {{0, 63, 127, 190, 318, 382, 447}, {0, 64, 129, 257, 320, 448, 577}, {}, {}, 447, 600, true},
      {{0, 1, 2, 3}, {0, 700, 1000, 2900}, {1, 0, 1}, {1, 0, 700}, 3, 3000, true},  // decode with seqused
      {{0, 700, 700, 1400}, {0, 800, 800, 1700}, {650, 0, 699}, {650, 0, 899}, 1400, 1710, true},
      {{0, 65, 130, 130, 195}, {0, 63, 63, 191, 320}, {64, 1, 0, 65}, {62, 0, 127, 1}, 200, 330, true},
      {{0, 0, 0}, {0, 5, 9}, {}, {}, 40, 9, true},  // no query rows: keys get dK = dV = 0 from their CTAs
      {{0, 40, 20, 90}, {90, 20, 40, 0}, {}, {}, 90, 120, false},  // decreasing
      {{-50, 10, -3, 90}, {17, 40, 5000, 80}, {kMax, -5, 7}, {kMax, -5, 7}, 90, 120, false},
      {{0, kMax, kMax, kMax}, {0, kMax, kMax, kMax}, {}, {}, 90, 120, false},
      {{17, 40, 60, 80}, {0, kMax, -7, 120}, {3, kMax, 0}, {3, kMax, 0}, 90, 120, false},  // not from zero
      {{0, 90, 90, 90}, {0, 0, 120, 120}, {kMax, kMax, kMax}, {-1, kMax, kMax}, 90, 120, false},
  };
  return all;
}

TEST(Sm90BwdVarlen, TheWalkStaysInBoundsAndCoversEveryUsedRowOnce) {
  const Band bands[] = {{-1, -1}, {-1, 0}, {50, 20}, {0, 0}};
  for (size_t i = 0; i < packings().size(); ++i) {
    SCOPED_TRACE("packing " + std::to_string(i));
    for (const Band band : bands) {
      check_walk<128>(packings()[i], 4, 2, band);  // D <= 128: 128 keys per CTA
      check_walk<64>(packings()[i], 2, 2, band);   // D 192 / 256: 64
    }
  }
}

// zero_rows on a host buffer laid out as the kernel's tile: rows [begin, end) zero, nothing else.
template <typename Mainloop, typename Layout, typename Slice>
void expect_exact_zero_rows(int rows, int stages, Slice slice) {
  using Element = typename Mainloop::Element;
  constexpr int kHeadDim = Mainloop::kHeadDim;
  using Swizzle = decltype(Layout{}.layout_a());
  constexpr int kBits = Swizzle::num_bits;
  constexpr int kElems = cute::cosize_v<Layout>;
  // The model: element (row, d, stage) at its unswizzled byte address with the hardware's swizzle applied.
  auto model = [](int row, int d, int stage) {
    int64_t bytes;
    if constexpr (cute::rank_v<Layout> == 3) {
      bytes = int64_t(Layout{}.layout_b()(cute::make_coord(row, d, stage))) * sizeof(Element);
    } else {
      bytes = int64_t(Layout{}.layout_b()(cute::make_coord(row, d))) * sizeof(Element);
    }
    return (bytes ^ (((bytes >> 7) & ((1 << kBits) - 1)) << 4)) / int64_t(sizeof(Element));
  };
  // Swizzled addresses depend on the buffer's alignment: 1024 bytes, as the kernel's shared storage.
  std::unique_ptr<Element, decltype(&std::free)> buffer(
      static_cast<Element*>(std::aligned_alloc(1024, (kElems * sizeof(Element) + 1023) / 1024 * 1024)), &std::free);
  ASSERT_NE(buffer, nullptr);
  auto tensor = cute::make_tensor(cute::make_smem_ptr(buffer.get()), Layout{});
  const struct { int begin, end, stage; } cases[] = {{61, rows, 0}, {1, rows, stages - 1}, {rows - 1, rows, 0},
                                                     {0, 3, stages - 1}, {33, 47, 0}, {5, 6, stages - 1}};
  for (auto c : cases) {
    c.begin = std::min(c.begin, rows - 7);
    c.end = std::min(c.end, rows);
    for (int i = 0; i < kElems; ++i) buffer.get()[i] = Element(1.f);
    for (int thread = 0; thread < Mainloop::kMmaThreads; ++thread) {
      Mainloop::zero_rows(slice(tensor, c.stage), c.begin, c.end, thread, Mainloop::kMmaThreads);
    }
    int wrong = 0;
    for (int stage = 0; stage < stages; ++stage) {
      for (int row = 0; row < rows; ++row) {
        for (int d = 0; d < kHeadDim; ++d) {
          const bool want_zero = stage == c.stage && row >= c.begin && row < c.end;
          wrong += (float(buffer.get()[model(row, d, stage)]) == 0.f) != want_zero;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "D " << kHeadDim << ": rows [" << c.begin << ", " << c.end << ") of stage " << c.stage;
  }
}

template <typename Element, int kHeadDim>
void expect_exact_zeroing() {
  using Mainloop = BwdMainloopSm90<Element, kHeadDim, /*kSoftcap=*/false, /*kVarlen=*/true>;
  SCOPED_TRACE(::testing::Message() << "D " << kHeadDim);
  // Q and dO: (kBlockM, D, stage), zeroed as mma does, through the stage's slice.
  expect_exact_zero_rows<Mainloop, typename Mainloop::SmemLayoutQdO>(
      Mainloop::kBlockM, Mainloop::kStages, [](auto& t, int stage) { return t(cute::_, cute::_, stage); });
  // K and V: (kBlockN, D), one tile.
  auto whole = [](auto& t, int) -> auto& { return t; };
  expect_exact_zero_rows<Mainloop, typename Mainloop::SmemLayoutK>(Mainloop::kBlockN, 1, whole);
  expect_exact_zero_rows<Mainloop, typename Mainloop::SmemLayoutV>(Mainloop::kBlockN, 1, whole);
}

TEST(Sm90BwdVarlen, ZeroRowsZeroesExactlyTheRowsAskedFor) {
  expect_exact_zeroing<cutlass::bfloat16_t, 64>();
  expect_exact_zeroing<cutlass::bfloat16_t, 96>();
  expect_exact_zeroing<cutlass::bfloat16_t, 128>();
  expect_exact_zeroing<cutlass::half_t, 128>();
  expect_exact_zeroing<cutlass::bfloat16_t, 192>();
  expect_exact_zeroing<cutlass::bfloat16_t, 256>();
}

}  // namespace
}  // namespace flashjax::sm90

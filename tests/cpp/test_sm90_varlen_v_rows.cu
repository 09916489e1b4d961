// The sm90 varlen forward zeroes the V rows of a box that lie past its sequence's used keys
// (FwdMainloopSm90::zero_v_rows, kernels/sm90/fwd_mainloop.cuh). Run here on a host buffer laid out as the kernel's
// V stages, every zero must land on exactly the rows asked for, judged by an independent model of where TMA and
// wgmma put element (d, key): the unswizzled layout's byte address with the hardware's swizzle applied to it (bits
// [4, 4 + B) of the address XOR bits [7, 7 + B), for the 32/64/128-byte modes B = 1/2/3). Addressing the runs by the
// layout's own function (the swizzle on element offsets) failed this on the rows 61 and 109 of a 128-key box,
// where the H200 showed wrong outputs and NaN from unzeroed padding.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "kernels/sm90/fwd_mainloop.cuh"

namespace flashjax::sm90 {
namespace {

template <typename Element, int kHeadDim, int kBlockN>
void expect_exact_zeroing() {
  using Mainloop = FwdMainloopSm90<Element, kHeadDim, kBlockN, /*kStagesK=*/2, /*kStagesV=*/2,
                                   /*kConsumerWarpgroups=*/2, /*kQStages=*/1, /*kSoftcap=*/false, /*kPackGqa=*/false,
                                   /*kSkipIdle=*/false, /*kVarlen=*/true>;
  using Layout = typename Mainloop::SmemLayoutVt;
  using Swizzle = decltype(Layout{}.layout_a());
  constexpr int kBits = Swizzle::num_bits;
  constexpr int kElems = cute::cosize_v<Layout>;
  constexpr int kStages = 2;
  // The model: byte address of (d, key, stage) as the hardware swizzles it, in elements.
  auto model = [](int d, int key, int stage) {
    const int64_t bytes = int64_t(Layout{}.layout_b()(cute::make_coord(d, key, stage))) * sizeof(Element);
    return (bytes ^ (((bytes >> 7) & ((1 << kBits) - 1)) << 4)) / int64_t(sizeof(Element));
  };
  // Swizzled addresses depend on the buffer's alignment: 1024 bytes, as the kernel's shared storage.
  std::unique_ptr<Element, decltype(&std::free)> buffer(
      static_cast<Element*>(std::aligned_alloc(1024, (kElems * sizeof(Element) + 1023) / 1024 * 1024)), &std::free);
  ASSERT_NE(buffer, nullptr);
  auto s_vt = cute::make_tensor(cute::make_smem_ptr(buffer.get()), Layout{});
  const struct { int begin, end, stage; } cases[] = {
      {61, kBlockN, 0}, {109, 115, 1}, {1, kBlockN, 1}, {kBlockN - 1, kBlockN, 0}, {0, 3, 1}, {60, 61, 0}};
  for (auto c : cases) {
    c.begin = c.begin < kBlockN ? c.begin : kBlockN - 7, c.end = c.end < kBlockN ? c.end : kBlockN;
    for (int i = 0; i < kElems; ++i) buffer.get()[i] = Element(1.f);
    for (int lane = 0; lane < 32; ++lane) Mainloop::zero_v_rows(s_vt, c.begin, c.end, c.stage, lane, 32);
    int wrong = 0;
    for (int stage = 0; stage < kStages; ++stage) {
      for (int key = 0; key < kBlockN; ++key) {
        for (int d = 0; d < kHeadDim; ++d) {
          const bool want_zero = stage == c.stage && key >= c.begin && key < c.end;
          const float got = float(buffer.get()[model(d, key, stage)]);
          wrong += (got == 0.f) != want_zero;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "D " << kHeadDim << " kBlockN " << kBlockN << ": rows [" << c.begin << ", " << c.end
                        << ") of stage " << c.stage;
  }
}

// The varlen kernel's widths and key blocks (FwdVarlenKernel: kFew's tiles, fwd_tile_sizes.cuh), both dtypes.
TEST(Sm90VarlenVRows, ZeroesExactlyTheRowsPastTheUsedKeys) {
  expect_exact_zeroing<cutlass::bfloat16_t, 64, 128>();
  expect_exact_zeroing<cutlass::bfloat16_t, 96, 128>();
  expect_exact_zeroing<cutlass::bfloat16_t, 128, 128>();
  expect_exact_zeroing<cutlass::half_t, 128, 128>();
  expect_exact_zeroing<cutlass::bfloat16_t, 192, 112>();
  expect_exact_zeroing<cutlass::bfloat16_t, 256, 80>();
}

}  // namespace
}  // namespace flashjax::sm90

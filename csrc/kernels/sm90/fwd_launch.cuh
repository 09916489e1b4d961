// Host launcher of the sm90 forward kernel: defines flashjax::sm90::run_fwd (declared in launch.h).
// Included by the generated instantiation files, one per (Element, head dim).
//
// Per call it follows the plan's choices in FwdParams (tile class, GQA packing, key splits: fwd_choices.cuh, asked
// by the plan through launch.h), builds the TMA descriptors (host-side encoding, no device work), sizes the
// persistent grid from the device's SM count and launches. Nothing here synchronizes,
// allocates or reads device memory, so the call can be captured into a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "flashjax/choices.h"
#include "flashjax/params.h"
#include "flashjax/settings.h"
#include "kernels/common/mask_block_lists.cuh"
#include "kernels/sm90/fwd_choices.cuh"
#include "kernels/sm90/fwd_kernel.cuh"
#include "kernels/sm90/fwd_split_combine.cuh"
#include "kernels/sm90/fwd_split_kv.h"
#include "kernels/sm90/fwd_varlen_scheduler.cuh"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tma_compatible.h"

namespace flashjax::sm90 {

namespace detail {

// Test knob: FLASHJAX_SM90_MAX_CTAS=n (flashjax/settings.h) caps the persistent grid at n CTAs, so that small
// problems (the sanitizer's, the GPU tests') run many tiles per CTA and reach the hand-over from one tile to the next.
inline int max_ctas_for_tests() { return setting_int(Setting::kSm90MaxCtas, 0); }

// FLASHJAX_SM90_PDL=0 launches without programmatic dependent launch, to compare the two in one build.
inline bool programmatic_launch() { return setting_int(Setting::kSm90Pdl, 1) != 0; }

// A launch on the stream, with programmatic dependent launch where programmatic_launch(): the kernel may start while
// the stream's previous kernel finishes, and must wait for it (griddepcontrol.wait) before its first global access.
struct StreamLaunch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attribute{};
  StreamLaunch(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream) {
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = programmatic_launch() ? 1 : 0;
  }
  StreamLaunch(const StreamLaunch&) = delete;  // config.attrs points into this object

  // Launches kernel(args...) with this configuration; the launch's error, else any error left by an earlier call.
  template <typename... Params, typename... Args>
  cudaError_t operator()(void (*kernel)(Params...), const Args&... args) {
    const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
    return err != cudaSuccess ? err : cudaGetLastError();
  }
};

// The scheduler's parameters for a call shape. Where work is uneven, to_params plans the last tiles on the host
// (fwd_tile_scheduler.cuh: tens of microseconds), the same plan for every call of one shape, so each kernel
// configuration remembers the plans of its last kCachedShapes shapes (a training step calls few shapes).
template <typename Scheduler, typename QueryTiling>
typename Scheduler::Params scheduler_params(const AttnShape& shape, const QueryTiling& tiling, int num_sms,
                                            bool mask_mod) {
  struct Key {
    int seqlen_q, seqlen_k, window_left, window_right, heads_q, batch, num_sms, group;
    bool mask_mod;
    bool operator==(const Key& o) const {
      return seqlen_q == o.seqlen_q && seqlen_k == o.seqlen_k && window_left == o.window_left &&
             window_right == o.window_right && heads_q == o.heads_q && batch == o.batch && num_sms == o.num_sms &&
             group == o.group && mask_mod == o.mask_mod;
    }
  };
  constexpr size_t kCachedShapes = 16;
  static std::mutex mutex;
  static std::vector<std::pair<Key, typename Scheduler::Params>> cache;  // oldest first
  const Key key{shape.seqlen_q, shape.seqlen_k, shape.window_left, shape.window_right,
                shape.heads_q,  shape.batch,    num_sms,           tiling.group, mask_mod};
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [cached_key, cached] : cache) {
    if (cached_key == key) return cached;
  }
  if (cache.size() == kCachedShapes) cache.erase(cache.begin());
  cache.push_back({key, Scheduler::to_params(shape, tiling, num_sms, mask_mod)});
  return cache.back().second;
}

// One kernel: TMA descriptors, persistent grid, launch. group: query heads per tile (1 unless Kernel packs GQA).
template <typename Kernel>
cudaError_t launch_kernel(const FwdParams& params, int group, cudaStream_t stream) {
  using Mainloop = typename Kernel::Mainloop;
  using Element = typename Mainloop::Element;
  constexpr int kHeadDim = Mainloop::kHeadDim;
  using Epilogue = typename Kernel::Epilogue;
  using Scheduler = typename Kernel::Scheduler;
  int device = 0;
  int num_sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (const int cap = max_ctas_for_tests(); cap > 0 && cap < num_sms) num_sms = cap;
  const typename Mainloop::QueryTiling tiling(group, params.seqlen_q);
  // A split kernel walks every part of every tile: the parts fold into the batch coordinate (fwd_split_epilogue.cuh).
  AttnShape walk = params;
  if constexpr (Kernel::kSplit) walk.batch = params.batch * params.num_splits;
  // Varlen's walk is the virtual blocks (fwd_varlen_scheduler.cuh): no host plan to cache, and the offsets' pointers
  // change from call to call.
  const typename Scheduler::Params scheduler = [&] {
    if constexpr (Kernel::kVarlen) {
      return Scheduler::to_params(walk, tiling, num_sms, params.varlen_tile_counter);
    } else {
      return scheduler_params<Scheduler>(walk, tiling, num_sms, Kernel::kMaskMod);
    }
  }();
  if (scheduler.num_tiles == 0) return cudaSuccess;  // Sq = 0, B = 0 or Hq = 0: nothing to write
  if (scheduler.num_tiles < 0) return cudaErrorInvalidConfiguration;
  if (!tma_compatible<Element>(params.q, params.q_row_stride, params.q_head_stride, params.q_batch_stride) ||
      !tma_compatible<Element>(params.k, params.k_row_stride, params.k_head_stride, params.k_batch_stride) ||
      !tma_compatible<Element>(params.v, params.v_row_stride, params.v_head_stride, params.v_batch_stride) ||
      (!Kernel::kSplit &&
       !tma_compatible<Element>(params.o, params.o_row_stride, params.o_head_stride, params.o_batch_stride))) {
    return cudaErrorInvalidValue;
  }

  // A TMA dimension cannot be 0: with Sk = 0 every tile is empty (the band has no key) and K/V are never loaded,
  // so a 1-row descriptor is never read through.
  const int seqlen_k_tma = params.seqlen_k > 0 ? params.seqlen_k : 1;
  const typename Mainloop::Arguments mainloop_args{
      static_cast<const Element*>(params.q),
      static_cast<const Element*>(params.k),
      static_cast<const Element*>(params.v),
      {params.seqlen_q, kHeadDim, params.heads_q, params.batch},
      {seqlen_k_tma, kHeadDim, params.heads_k, params.batch},
      {params.q_row_stride, cute::_1{}, params.q_head_stride, params.q_batch_stride},
      {params.k_row_stride, cute::_1{}, params.k_head_stride, params.k_batch_stride},
      {params.v_row_stride, cute::_1{}, params.v_head_stride, params.v_batch_stride}};
  typename Kernel::Params kernel_params{Mainloop::to_params(mainloop_args),
                                              Epilogue::to_params(params),
                                              scheduler,
                                              params.seqlen_q,
                                              params.seqlen_k,
                                              params.window_left,
                                              params.window_right,
                                              params.softmax_scale,
                                              params.softcap,
                                              params.heads_q / params.heads_k,
                                              params.sinks,
                                              tiling};
  if constexpr (Kernel::kMaskMod) {  // the bits and the block lists, read per tile
    kernel_params.mask = common::MaskModTiles::of<Mainloop::kBlockM, Mainloop::kBlockN>(params);
  }

  // The scheduler's tail plan rides in the parameters: stay within the classic 4 KB of kernel parameter space.
  static_assert(sizeof(typename Kernel::Params) <= 4096, "kernel parameters over 4 KB");
  auto kernel = fwd_kernel_sm90<Kernel>;
  // Above 48 KB dynamic shared memory is opt-in per kernel. Setting an attribute is not a stream operation, so it
  // is legal during CUDA-graph capture.
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) return err;
  // Programmatic dependent launch: the kernel may start while the stream's previous kernel finishes (launch
  // latency and the CTAs' prologue overlap that kernel's last CTAs); it waits for it before any global access.
  return StreamLaunch(dim3(Scheduler::grid_size(scheduler)), dim3(Kernel::kThreads), Kernel::kSmemBytes,
                      stream)(kernel, kernel_params);
}

// One tile configuration: the kernel compiled for the call's softcap (none, or any c > 0).
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, bool kPackGqa, bool kSplitKv = false,
          bool kVarlen = false, bool kMaskMod = false>
cudaError_t launch_fwd(const FwdParams& params, int group, cudaStream_t stream) {
  using Capped = FwdKernelSm90<Element, kHeadDim, kBlockM, kBlockN, true, kPackGqa, kSplitKv, kVarlen, kMaskMod>;
  using Uncapped = FwdKernelSm90<Element, kHeadDim, kBlockM, kBlockN, false, kPackGqa, kSplitKv, kVarlen, kMaskMod>;
  return params.softcap > 0.f ? launch_kernel<Capped>(params, group, stream)
                              : launch_kernel<Uncapped>(params, group, stream);
}

// The uncapped kernel of one FwdKeyLoad class (classes with equal tile sizes share it; the capped twin has the same
// tiles and shared memory), packing GQA or not, splitting keys or not.
template <typename Element, int kHeadDim, FwdKeyLoad kLoad, bool kPackGqa = false, bool kSplitKv = false,
          bool kVarlen = false, bool kMaskMod = false>
using FwdKernelFor = FwdKernelSm90<Element, kHeadDim, fwd_tile_sizes(kHeadDim, kLoad).block_m,
                                   fwd_tile_sizes(kHeadDim, kLoad).block_n, false, kPackGqa, kSplitKv, kVarlen,
                                   kMaskMod>;

template <typename Element, int kHeadDim, FwdKeyLoad kLoad>
cudaError_t launch_fwd_for(const FwdParams& params, cudaStream_t stream) {
  using Kernel = FwdKernelFor<Element, kHeadDim, kLoad>;
  return launch_fwd<Element, kHeadDim, Kernel::Mainloop::kBlockM, Kernel::Mainloop::kBlockN, false>(params, 1,
                                                                                                     stream);
}

// Packed GQA takes kFew's tiles whatever the key load (the calls the rule packs have short query sequences, which
// key_load classes kFew), so that it adds two kernels (with and without softcap) per instantiation, not six.
template <typename Element, int kHeadDim>
using FwdPackedKernel = FwdKernelFor<Element, kHeadDim, FwdKeyLoad::kFew, true>;

template <typename Element, int kHeadDim>
cudaError_t launch_packed(const FwdParams& params, int group, cudaStream_t stream) {
  using Kernel = FwdPackedKernel<Element, kHeadDim>;
  return launch_fwd<Element, kHeadDim, Kernel::Mainloop::kBlockM, Kernel::Mainloop::kBlockN, true>(params, group,
                                                                                                    stream);
}

// The split-keys kernel: kFew's tiles, packed (any group, 1 included: fwd_split_epilogue.cuh indexes rows by query
// head). The uncapped one; launch_fwd picks it or its capped twin, as for every tile configuration.
template <typename Element, int kHeadDim>
using FwdSplitKernel = FwdKernelFor<Element, kHeadDim, FwdKeyLoad::kFew, true, true>;

// Split keys (fwd_split_kv.h): the parts into the workspace, then the combine into O and LSE. The combine launches
// programmatically too: its launch overlaps the parts' last CTAs, and it waits for all of them (griddepcontrol.wait)
// before it reads the workspace.
template <typename Element, int kHeadDim>
cudaError_t launch_split(const FwdParams& params, cudaStream_t stream) {
  if (params.o_partial == nullptr || params.lse_partial == nullptr || params.num_splits > kMaxKvSplits) {
    return cudaErrorInvalidValue;
  }
  using Split = FwdSplitKernel<Element, kHeadDim>;
  cudaError_t err = launch_fwd<Element, kHeadDim, Split::Mainloop::kBlockM, Split::Mainloop::kBlockN, true, true>(
      params, params.heads_q / params.heads_k, stream);
  const int64_t rows = int64_t(params.batch) * params.heads_q * params.seqlen_q;
  if (err != cudaSuccess || rows == 0) return err;
  const dim3 grid(static_cast<unsigned>((rows + kCombineWarps - 1) / kCombineWarps));
  return StreamLaunch(grid, dim3(kCombineWarps * 32), 0, stream)(fwd_split_combine_kernel<Element, kHeadDim>, params);
}

// Packed sequences (varlen): kFew's tiles (fwd_choices_for: the virtual blocks are short sequences' as often as long
// ones', and the class is chosen from the token counts only), unsplit; with GQA packed where the plan says so
// (decode-like calls: short query sequences, where a group's query heads then share each tile and its K/V loads).
template <typename Element, int kHeadDim, bool kPackGqa = false>
using FwdVarlenKernel = FwdKernelFor<Element, kHeadDim, FwdKeyLoad::kFew, kPackGqa, false, true>;

// The rows no tile writes get out = 0, lse = -inf (fwd_varlen_scheduler.cuh), then the tiles run. The two write
// disjoint rows, so their order does not matter; the fill goes first because it is short and the main kernel then
// overlaps its tail (programmatic dependent launch). The fill also zeroes the dynamic walk's counter: a stream-ordered
// write before every launch without an operation of its own (the main kernel touches it only after
// griddepcontrol.wait, which waits for the fill; the fill, launched without PDL, waits for the previous kernel).
template <typename Element, int kHeadDim, bool kPackGqa>
cudaError_t launch_varlen_kernels(const FwdParams& params, int group, cudaStream_t stream) {
  using Kernel = FwdVarlenKernel<Element, kHeadDim, kPackGqa>;
  using Scheduler = typename Kernel::Scheduler;
  if (params.seqlen_q == 0 || params.heads_q == 0) return cudaSuccess;  // no rows
  // The fill's 16-byte stores need what TMA needs of O (the main kernel checks q, k, v too).
  if (!tma_compatible<Element>(params.o, params.o_row_stride, params.o_head_stride, params.o_batch_stride)) {
    return cudaErrorInvalidValue;
  }
  const typename Scheduler::Params scheduler =
      Scheduler::to_params(params, typename Kernel::Mainloop::QueryTiling(group, params.seqlen_q), /*num_sms=*/1,
                           params.varlen_tile_counter);  // the main kernel's walk: its order decides row_written
  if (scheduler.num_tiles < 0) return cudaErrorInvalidConfiguration;
  constexpr int kFillThreads = 256;
  const int64_t fill_blocks = std::min<int64_t>((int64_t(params.seqlen_q) + kFillThreads - 1) / kFillThreads, 2048);
  fwd_varlen_fill_unwritten_kernel<Element, kHeadDim, Scheduler>
      <<<static_cast<unsigned>(fill_blocks), kFillThreads, 0, stream>>>(scheduler, params);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (params.num_seqs == 0) return cudaSuccess;  // every row was padding
  return launch_fwd<Element, kHeadDim, Kernel::Mainloop::kBlockM, Kernel::Mainloop::kBlockN, kPackGqa, false, true>(
      params, group, stream);
}

template <typename Element, int kHeadDim>
cudaError_t launch_varlen(const FwdParams& params, cudaStream_t stream) {
  if (params.batch != 1 || params.num_seqs < 0 || params.num_splits != 1) return cudaErrorInvalidValue;
  // Packed GQA only with the whole group (the packed tiling indexes query heads by it).
  if (params.pack_group > 1) {
    if (params.pack_group != params.heads_q / params.heads_k) return cudaErrorInvalidValue;
    return launch_varlen_kernels<Element, kHeadDim, true>(params, params.pack_group, stream);
  }
  if (params.pack_group != 1) return cudaErrorInvalidValue;
  return launch_varlen_kernels<Element, kHeadDim, false>(params, 1, stream);
}

// A mask mod: one tile configuration per head dim (mask_mod_key_load: n-blocks of whole 32-key words), unpacked and
// unsplit, each tile walking its block list.
template <typename Element, int kHeadDim>
using FwdMaskModKernel = FwdKernelFor<Element, kHeadDim, mask_mod_key_load(kHeadDim), false, false, false, true>;

// The tile classes and block lists for this kernel's tiles (kernels/common/mask_block_lists.cuh), then the tiles;
// all on `stream`.
template <typename Element, int kHeadDim>
cudaError_t launch_mask_mod(const FwdParams& params, cudaStream_t stream) {
  using Kernel = FwdMaskModKernel<Element, kHeadDim>;
  constexpr int kBlockM = Kernel::Mainloop::kBlockM, kBlockN = Kernel::Mainloop::kBlockN;
  if (params.cu_seqlens_q != nullptr || params.mask_tile_classes == nullptr || params.mask_block_lists == nullptr ||
      params.pack_group != 1 || params.num_splits != 1) {
    return cudaErrorInvalidValue;  // dense calls only, with the workspace the plan sized for these tiles
  }
  const cudaError_t err = common::launch_mask_block_lists<kBlockM, kBlockN>(params, stream);
  if (err != cudaSuccess) return err;
  return launch_fwd<Element, kHeadDim, kBlockM, kBlockN, false, false, false, true>(params, 1, stream);
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  if (params.head_dim != kHeadDim || params.heads_k <= 0 || params.heads_q % params.heads_k != 0 ||
      params.seqlen_q < 0 || params.seqlen_k < 0 || params.batch < 0) {
    return cudaErrorInvalidValue;
  }
  // A mask mod: its kernel whatever the tile class (the plan chose its tiles: fwd_choices_for).
  if (params.mask_bits != nullptr) return detail::launch_mask_mod<Element, kHeadDim>(params, stream);
  // Packed sequences: the varlen kernel whatever the tile class (the plan chose it for varlen: fwd_choices_for).
  if (params.cu_seqlens_q != nullptr) return detail::launch_varlen<Element, kHeadDim>(params, stream);
  // The plan's choices (fwd_choices below): split keys into the workspace the lowering allocated, else packed GQA
  // (only with the whole group: the packed tiling indexes query heads by it), else the tile class.
  if (params.num_splits > 1) return detail::launch_split<Element, kHeadDim>(params, stream);
  if (params.pack_group > 1) {
    if (params.pack_group != params.heads_q / params.heads_k) return cudaErrorInvalidValue;
    return detail::launch_packed<Element, kHeadDim>(params, params.pack_group, stream);
  }
  switch (static_cast<FwdKeyLoad>(params.tile_class)) {
    case FwdKeyLoad::kFewShortBand:
      return detail::launch_fwd_for<Element, kHeadDim, FwdKeyLoad::kFewShortBand>(params, stream);
    case FwdKeyLoad::kFew:
      return detail::launch_fwd_for<Element, kHeadDim, FwdKeyLoad::kFew>(params, stream);
    case FwdKeyLoad::kManyShortRows:
      return detail::launch_fwd_for<Element, kHeadDim, FwdKeyLoad::kManyShortRows>(params, stream);
    default:
      return detail::launch_fwd_for<Element, kHeadDim, FwdKeyLoad::kMany>(params, stream);
  }
}

// Declared in launch.h: the choices run_fwd follows, for the plan (any FwdKeyLoad serves any call correctly; the
// choice is about speed).
template <typename Element, int kHeadDim>
FamilyChoices fwd_choices(const AttnShape& shape, const ChoiceQuery& query) {
  return fwd_choices_for(kHeadDim, shape, query);
}

// Declared in launch.h: the most dynamic shared memory any launch of run_fwd requests, i.e. the largest of its tiles'
// kernels (launch_fwd launches FwdKernelSm90 with its kSmemBytes).
template <typename Element, int kHeadDim>
int fwd_smem_bytes() {
  constexpr int kShort = detail::FwdKernelFor<Element, kHeadDim, FwdKeyLoad::kFewShortBand>::kSmemBytes;
  constexpr int kFew = detail::FwdKernelFor<Element, kHeadDim, FwdKeyLoad::kFew>::kSmemBytes;
  constexpr int kMany = detail::FwdKernelFor<Element, kHeadDim, FwdKeyLoad::kMany>::kSmemBytes;
  constexpr int kManyShort = detail::FwdKernelFor<Element, kHeadDim, FwdKeyLoad::kManyShortRows>::kSmemBytes;
  constexpr int kPacked = detail::FwdPackedKernel<Element, kHeadDim>::kSmemBytes;
  constexpr int kSplit = detail::FwdSplitKernel<Element, kHeadDim>::kSmemBytes;
  constexpr int kVarlen = detail::FwdVarlenKernel<Element, kHeadDim>::kSmemBytes;
  constexpr int kVarlenPacked = detail::FwdVarlenKernel<Element, kHeadDim, true>::kSmemBytes;
  constexpr int kMaskMod = detail::FwdMaskModKernel<Element, kHeadDim>::kSmemBytes;
  return std::max({kShort, kFew, kMany, kManyShort, kPacked, kSplit, kVarlen, kVarlenPacked, kMaskMod});
}

}  // namespace flashjax::sm90

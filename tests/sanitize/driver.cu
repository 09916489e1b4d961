// flashjax_sanitize: flashjax's kernels launched straight from C++ for compute-sanitizer (memcheck, racecheck,
// synccheck). A JAX process under racecheck crashes the tool, and XLA's own kernels and allocator only add noise,
// so this program has no Python or XLA in it: it links the objects libflashjax.so links, picks each kernel through
// the library's table and dispatcher (FLASHJAX_DISABLE_FAMILIES honoured the same way), fills FwdParams/BwdParams
// with the FFI handlers' strides and workspace sizes, and runs forward then backward on short ragged configs, then on
// packed (varlen) configs with well-formed and malformed offsets. The varlen configs' sm90 forward runs its run-time
// walk by default (the counter workspace allocated as the plan asks, poisoned: the launcher zeroes it);
// FLASHJAX_SM90_VARLEN_WALK=0 or 1 runs the static walks.
//
//   flashjax_sanitize              run every config; one line each, ending in ": ok" or ": FAILED <why>"
//   flashjax_sanitize --only N     run config N only (repeatable)
//   flashjax_sanitize --list       print the configs and exit (no GPU needed)
// Exit status 0 when every config passed, 1 otherwise.
//
// Each config runs on one (dtype, head dim) pair that both directions have a kernel for on this device, taken in
// turn from the pairs the build holds, so the full kernel set spreads its widths over the configs and the CI set
// runs them all on bf16 / 64. Inputs are random normals (never zeros). Every output and workspace buffer starts as
// NaN, so a kernel that leaves any element unwritten fails the checks; every tensor is its own exact-size
// allocation, so memcheck sees any access past its end. The checks are sanity, not accuracy (tests/gpu holds the
// kernel-vs-reference tests): the forward against a float64 reference on the same rounded inputs, the gradients
// finite, and the zeros promised (docs/design.md §2.5): empty rows get out = 0, lse = -inf (the sink logit
// with sinks) and dq = 0; keys no row sees get dk = dv = 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/dispatch.h"
#include "ffi/kernel_table.h"
#include "ffi/strides.h"
#include "flashjax/mask_grid.h"
#include "flashjax/params.h"
#include "flashjax/workspace.h"
#include "kernels/sm80/bwd_tile_sizes.cuh"

static_assert(flashjax::kBwdSeqlenQRounding == flashjax::sm80::kBwdSeqlenQRounding,
              "the workspace rounding the FFI layer allocates by must be the one the sm80 backward requires");

namespace {

using flashjax::BwdParams;
using flashjax::DType;
using flashjax::FwdParams;
using flashjax::JvpParams;
using flashjax::KernelEntry;
using flashjax::TangentParams;

// One problem. window_right = 0 is causal (docs/design.md §2.3); -1 leaves a side unbounded.
struct Config {
  int batch, seqlen_q, seqlen_k, heads_q, heads_k;
  int window_left, window_right;
  bool sinks;
  float softcap;
  bool dlse;  // pass a cotangent for lse (the backward's optional input)
  const char* what;
  int head_dim = 0;  // the variant to run: 0 takes the configs' rotation over the variants, else this head dim's first
  int num_splits = 1;  // > 1: the forward splits keys into this many parts (sm90; other families ignore it)
  bool deterministic = false;  // the backward orders its dq adds (runs where the variant's backward can)
  // A mask mod's bits (issue 38; the mask-mod kernels dispatch picks): none, or random bits [Bm, Hm, Sq, Wk] shared by
  // every batch entry and head, per batch (Bm = B), or per batch and query head (Bm = B, Hm = Hq).
  enum MaskBits { kNoMask, kMaskShared, kMaskPerBatch, kMaskPerHead } mask = kNoMask;
};

// Ragged lengths (1, 77, 129, 130, 300: never a multiple of a tile), Sq < Sk and Sq > Sk, GQA 4/2 and MQA 4/1,
// causal, windows that empty rows, sinks, softcap, and empty sequences on either side. The sm90 forward packs the
// GQA configs with short Sq (fwd_pack_gqa.h: 130/77, 1/300, 77/300, 9/300). A config with a head dim runs that
// variant only: config 13 reaches sm90's D 256 kernel for unbanded rows of at most 512 keys (128 x 64 tiles). The next
// three split keys (sm90's split kernel and its combine, fwd_split_kv.h; the parts' workspace poisoned), the third
// with softcap. The deterministic ones close the list, the last two on the sm90 backward's 64-key plan at D 256 and
// 192 (bwd_tile_sizes.cuh).
const Config kConfigs[] = {
    {2, 77, 130, 4, 2, -1, -1, false, 0.f, false, "full attention, ragged Sq < Sk, GQA 4/2"},
    {1, 130, 77, 4, 2, -1, -1, false, 5.f, true, "full attention, Sq > Sk, softcap 5, dlse"},
    {2, 300, 130, 4, 2, -1, 0, false, 0.f, false, "causal, Sq > Sk: the first 170 rows see no key"},
    {1, 77, 300, 4, 1, -1, 0, true, 0.f, true, "causal, Sq < Sk, MQA 4/1, sinks, dlse"},
    {2, 1, 300, 4, 1, -1, 0, true, 0.f, false, "decode: one query against 300 keys, sinks"},
    {1, 130, 1, 2, 2, -1, -1, false, 30.f, false, "a single key, softcap 30"},
    {1, 300, 77, 4, 2, 16, 3, true, 0.f, false, "window (16, 3), Sq > Sk: rows 0..219 empty, with sinks"},
    {2, 130, 300, 2, 1, 32, 7, false, 5.f, true, "two-sided window (32, 7), Sq < Sk, softcap 5, dlse"},
    {1, 129, 129, 4, 4, 0, 0, true, 0.f, false, "window (0, 0): the diagonal only, sinks"},
    {1, 300, 300, 4, 2, 64, 0, true, 30.f, true, "causal + left window 64, softcap 30, sinks, dlse"},
    {2, 0, 77, 4, 2, -1, 0, false, 0.f, false, "Sq = 0: no queries, dk = dv = 0"},
    {1, 77, 0, 4, 2, -1, -1, true, 0.f, true, "Sk = 0: every row empty, sinks, dlse"},
    {2, 9, 300, 16, 2, -1, 0, true, 0.f, true, "GQA 16/2 packed (8 heads per sm90 tile), causal Sq 9 < Sk, sinks"},
    {2, 300, 500, 4, 2, -1, -1, true, 0.f, true, "full attention, Sk 500 (sm90 D 256: 128 x 64 tiles), sinks, dlse",
     256},
    {1, 1, 1500, 8, 2, -1, -1, true, 0.f, false, "decode, keys split into 6 parts (sm90), GQA 8/2 packed, sinks", 0, 6},
    {2, 300, 130, 4, 2, -1, 0, true, 0.f, true, "causal Sq > Sk, keys split into 3 parts: empty rows and parts", 128,
     3},
    {1, 1, 2000, 16, 4, -1, -1, false, 30.f, true, "decode, softcap 30, keys split into 5 parts (the capped twin)", 128,
     5},
    {2, 300, 700, 4, 2, -1, 0, true, 0.f, true, "deterministic: causal Sq < Sk, GQA 4/2, sinks (ordered dsinks), dlse",
     128, 1, true},
    {1, 300, 300, 4, 2, 32, 7, false, 5.f, false, "deterministic: two-sided window (32, 7), softcap 5", 64, 1, true},
    {1, 300, 130, 4, 2, -1, 0, true, 0.f, true, "deterministic, sm90 D 256 (64-key CTAs split along D): causal Sq > Sk",
     256, 1, true},
    {2, 130, 300, 4, 1, 32, 7, false, 5.f, false, "deterministic, sm90 D 192: window (32, 7), softcap 5, MQA 4/1", 192,
     1, true},
    // Every config runs the tangent (jax.jvp) after the forward where a tangent kernel exists; this one reaches the
    // sm80 tangent's D 256 tiles (64 x 32 in 163 KB, 64 x 16 under FLASHJAX_SMEM_LIMIT_KB=99) with every feature.
    {1, 200, 333, 4, 2, 40, 9, true, 5.f, false, "tangent D 256: window (40, 9), softcap 5, sinks, GQA 4/2", 256},
    // Mask mods: random bits built from 32 x 32 blocks that are all 0, all 1 or random, so each pass's tiles (their
    // own shapes) are empty, full and partial; rows and keys the bits leave empty included.
    {2, 300, 517, 4, 2, -1, -1, false, 0.f, true, "mask bits shared by batch and heads, Sq < Sk, GQA 4/2, dlse", 0, 1,
     false, Config::kMaskShared},
    {2, 517, 300, 4, 1, -1, 0, true, 0.f, false, "mask bits per batch, causal Sq > Sk, MQA 4/1, sinks", 0, 1, false,
     Config::kMaskPerBatch},
    {1, 333, 333, 4, 2, 48, 5, false, 5.f, true, "mask bits per head, window (48, 5), softcap 5, dlse", 0, 1, false,
     Config::kMaskPerHead},
    {2, 1, 700, 8, 2, -1, -1, true, 0.f, false, "mask bits per head, decode Sq 1 against 700 keys, sinks", 0, 1, false,
     Config::kMaskPerHead},
    // The mask-mod tangents' widest tiles (32-key steps: sm90 128 x 32, sm80 64 x 32) and the 64-key ones at D 128,
    // with softcap and sinks (their tangent too); the configs above run the tangent with their bits as well.
    {1, 200, 333, 4, 2, 40, 9, true, 5.f, false, "mask bits per head, tangent D 256: window (40, 9), softcap 5, sinks",
     256, 1, false, Config::kMaskPerHead},
    {2, 390, 270, 4, 1, -1, 0, true, 30.f, false, "mask bits per batch, tangent D 128: causal Sq > Sk, softcap 30",
     128, 1, false, Config::kMaskPerBatch},
    // The sm90 backward's mask-mod variant at both CTA shapes (128 keys at D 64 / 128, 64 keys at D 192 / 256):
    // per-head bits under GQA, so the heads of a CTA's group walk different query-block lists, some empty.
    {2, 300, 517, 8, 2, -1, 0, false, 0.f, true, "mask bits per head, causal Sq < Sk, GQA 8/2, D 64, dlse", 64, 1,
     false, Config::kMaskPerHead},
    {1, 517, 300, 4, 2, 100, 20, true, 5.f, false, "mask bits per head, window (100, 20), softcap 5, sinks, D 256", 256,
     1, false, Config::kMaskPerHead},
    {2, 130, 257, 6, 3, -1, -1, false, 0.f, true, "mask bits per batch, Sq < Sk, GQA 6/3, D 192, dlse", 192, 1, false,
     Config::kMaskPerBatch},
    // deterministic=True with a mask mod: the ordered dQ adds ranked by the tile classes (the turns skip the empty tiles
    // the lists leave out; a wrong count would hang here or read past the counters).
    {2, 300, 517, 8, 2, -1, 0, true, 0.f, true, "deterministic, mask bits per head, causal Sq < Sk, GQA 8/2, sinks",
     128, 1, true, Config::kMaskPerHead},
};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);

// A compiled (dtype, head dim) with the kernels dispatch picks for it on this device.
struct Variant {
  DType dtype;
  int head_dim;
  const KernelEntry* fwd;
  const KernelEntry* bwd;
  const KernelEntry* varlen_fwd;  // what dispatch picks for varlen (nullptr: none)
  const KernelEntry* varlen_bwd;
  const KernelEntry* tangent;  // nullptr: no tangent kernel for this variant (the config then skips the tangent)
  const KernelEntry* varlen_tangent;  // what dispatch picks for a varlen tangent (nullptr: none)
  const KernelEntry* mask_fwd;  // what dispatch picks for a mask mod (nullptr: none)
  const KernelEntry* mask_bwd;
  const KernelEntry* mask_tangent;  // the mask-mod configs' tangent (sm90 on Hopper, else sm80; nullptr: none)
  const KernelEntry* varlen_mask_fwd;  // what dispatch picks for varlen with a mask mod (sm80; nullptr: none)
  const KernelEntry* varlen_mask_bwd;
  const KernelEntry* jvp = nullptr;  // the fused jvp (sm90, D <= 128; nullptr: none, the config skips it)
};

struct Failure {
  std::string why;
};

#define CUDA_CHECK(expr)                                                                                 \
  do {                                                                                                   \
    const cudaError_t err_ = (expr);                                                                     \
    if (err_ != cudaSuccess) throw Failure{std::string(#expr) + ": " + cudaGetErrorString(err_)};        \
  } while (0)

const char* dtype_name(DType dtype) { return dtype == DType::kFloat16 ? "fp16" : "bf16"; }

std::string describe(const Config& c) {
  char buf[256];
  const char* masks[] = {"", " mask bits (shared)", " mask bits (per batch)", " mask bits (per head)"};
  std::snprintf(buf, sizeof(buf), "B%d Sq%d Sk%d H%d/%d window(%d,%d)%s%s%s%s", c.batch, c.seqlen_q, c.seqlen_k,
                c.heads_q, c.heads_k, c.window_left, c.window_right, c.sinks ? " sinks" : "",
                c.softcap > 0.f ? (" softcap=" + std::to_string(static_cast<int>(c.softcap))).c_str() : "",
                c.dlse ? " dlse" : "", masks[c.mask]);
  return buf;
}

// ---------------------------------------------------------------------------------------------- device buffers
// Every tensor is its own cudaMalloc of exactly its size. A zero-element tensor gets a 16-byte block instead of
// null (no row of any tensor fits in 16 bytes, so memcheck still flags a read through it; XLA hands the handlers
// non-null pointers too).
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <typename T>
  T* alloc(int64_t elements) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(16, sizeof(T) * static_cast<size_t>(elements))));
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }

 private:
  std::vector<void*> blocks_;
};

__host__ __device__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename T>
__device__ T from_float(float x);
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ float from_float<float>(float x) { return x; }

// Normal(0, 1) samples (Box-Muller on a counter hash): a pure function of (seed, index), so runs repeat exactly.
template <typename T>
__global__ void fill_normal(T* out, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i)));
    const float u1 = (static_cast<float>(h >> 40) + 1.f) * 0x1p-24f;                // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xFFFFFFu) * 0x1p-24f;          // [0, 1)
    out[i] = from_float<T>(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

template <typename T>
void fill(T* out, int64_t n, uint64_t seed) {
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 1024));
  fill_normal<T><<<blocks, 256>>>(out, n, seed);
  CUDA_CHECK(cudaGetLastError());
}

// q/k/v/o/dout and their gradients are 16-bit elements of the problem's dtype.
void* alloc_element(Arena& arena, int64_t n) { return arena.alloc<uint16_t>(n); }

void fill_element(void* out, int64_t n, DType dtype, uint64_t seed) {
  if (dtype == DType::kFloat16) {
    fill(static_cast<__half*>(out), n, seed);
  } else {
    fill(static_cast<__nv_bfloat16*>(out), n, seed);
  }
}

// All bits set is NaN in f32, fp16 and bf16 alike.
void poison(void* p, int64_t bytes) {
  if (bytes > 0) CUDA_CHECK(cudaMemset(p, 0xFF, static_cast<size_t>(bytes)));
}

// ---------------------------------------------------------------------------------------------- host side
float element_to_float(uint16_t bits, DType dtype) {
  if (dtype == DType::kFloat16) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  }
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

std::vector<float> elements_to_host(const void* dev, int64_t n, DType dtype) {
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  if (n > 0) CUDA_CHECK(cudaMemcpy(bits.data(), dev, sizeof(uint16_t) * n, cudaMemcpyDeviceToHost));
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = element_to_float(bits[i], dtype);
  return out;
}

std::vector<float> floats_to_host(const float* dev, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  if (n > 0) CUDA_CHECK(cudaMemcpy(out.data(), dev, sizeof(float) * n, cudaMemcpyDeviceToHost));
  return out;
}

// The keys query row i sees, [lo, hi] (empty when lo > hi): docs/design.md §2.3, bottom-right aligned.
struct KeyRange {
  int64_t lo, hi;
};

KeyRange visible_keys(const Config& c, int64_t i) {
  const int64_t offset = int64_t(c.seqlen_k) - c.seqlen_q;
  int64_t lo = 0, hi = int64_t(c.seqlen_k) - 1;
  if (c.window_right >= 0) hi = std::min(hi, i + offset + c.window_right);
  if (c.window_left >= 0) lo = std::max(lo, i + offset - c.window_left);
  return {lo, hi};
}

// A config's mask bits on the host (flashjax/params.h's layout), from 32 x 32 blocks each all 0, all 1 or random.
struct HostMask {
  int batches = 0, heads = 0, seqlen_q = 0, words = 0;  // [Bm, Hm, Sq, Wk]
  std::vector<uint32_t> bits;

  bool visible(int b, int h, int64_t i, int64_t j) const {
    if (bits.empty()) return true;
    const int64_t word = ((int64_t(batches > 1 ? b : 0) * heads + (heads > 1 ? h : 0)) * seqlen_q + i) * words + j / 32;
    return (bits[word] >> (j % 32)) & 1u;
  }
};

HostMask make_mask(const Config& c, uint64_t seed) {
  HostMask m;
  if (c.mask == Config::kNoMask) return m;
  m.batches = c.mask == Config::kMaskShared ? 1 : c.batch;
  m.heads = c.mask == Config::kMaskPerHead ? c.heads_q : 1;
  m.seqlen_q = c.seqlen_q;
  m.words = flashjax::mask_bits_words(c.seqlen_k);
  m.bits.assign(size_t(m.batches) * m.heads * m.seqlen_q * m.words, 0u);
  for (int b = 0; b < m.batches; ++b) {
    for (int h = 0; h < m.heads; ++h) {
      for (int i = 0; i < m.seqlen_q; ++i) {
        for (int w = 0; w < m.words; ++w) {
          const uint64_t block = splitmix64(seed ^ splitmix64((uint64_t(b) * 977 + h) * 1000003 + i / 32) ^ w);
          const uint64_t kind = block % 3;  // 0: empty block, 1: full, 2: random bits
          uint32_t word = kind == 0 ? 0u : kind == 1 ? 0xFFFFFFFFu : uint32_t(splitmix64(block ^ (i + 1)));
          const int valid = c.seqlen_k - 32 * w;  // bits for keys >= Sk are 0 (the contract)
          if (valid < 32) word &= (1u << valid) - 1u;
          m.bits[((size_t(b) * m.heads + h) * m.seqlen_q + i) * m.words + w] = word;
        }
      }
    }
  }
  return m;
}

// The bits uploaded and their fields set as the FFI handler sets them (fill_mask_bits; fill_varlen_mask_bits for a
// packed shape, whose bits cover its sequences padded to m.seqlen_q rows), and this pass's tile-class workspace as the
// plan sizes it for the kernel's tiles over the bits' grid (mask_grid.h), poisoned (the tile-class kernel must write
// every entry read).
void attach_mask(Arena& arena, const HostMask& m, const KernelEntry& kernel, flashjax::AttnShape& shape) {
  if (m.bits.empty()) return;
  uint32_t* bits = arena.alloc<uint32_t>(int64_t(m.bits.size()));
  CUDA_CHECK(cudaMemcpy(bits, m.bits.data(), m.bits.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
  shape.mask_bits = bits;
  shape.mask_words = m.words;
  shape.mask_seqlen_q = m.seqlen_q;
  shape.mask_head_stride = m.heads > 1 ? int64_t(m.seqlen_q) * m.words : 0;
  shape.mask_batch_stride = m.batches > 1 ? int64_t(m.heads) * m.seqlen_q * m.words : 0;
  flashjax::ChoiceQuery query;
  query.mask_mod = true;
  query.varlen = shape.cu_seqlens_q != nullptr;
  const flashjax::FamilyChoices choices = kernel.choices(shape, query);
  const flashjax::AttnShape grid = flashjax::mask_bits_grid(shape);
  const flashjax::MaskTileClassesLayout layout =
      flashjax::mask_tile_classes_layout(grid.batch, grid.heads_q, grid.seqlen_q, grid.seqlen_k, choices.block_m,
                                         choices.block_n, choices.mask_block_lists);
  uint8_t* workspace = arena.alloc<uint8_t>(layout.bytes);
  poison(workspace, layout.bytes);
  // As the FFI handler splits it (take_mask_tile_classes): the block lists first where the kernel walks them.
  shape.mask_block_lists = layout.block_lists(workspace);
  shape.mask_tile_classes = layout.tile_classes(workspace);
}

void expect_finite(const std::vector<float>& x, const char* name) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) throw Failure{std::string(name) + "[" + std::to_string(i) + "] = " +
                                            std::to_string(x[i]) + " is not finite"};
  }
}

// ---------------------------------------------------------------------------------------------- one config
template <typename Params>
cudaError_t launch(const KernelEntry& entry, const Params& params, cudaStream_t stream) {
  using LaunchFn = cudaError_t (*)(const Params&, cudaStream_t);
  return reinterpret_cast<LaunchFn>(entry.launch)(params, stream);
}

// The problem's fields as the FFI handlers fill them (fill_shape; fill_varlen_shape with batch 1), strides included.
FwdParams problem_params(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_k, int D, DType dtype,
                         float softcap, int window_left, int window_right) {
  FwdParams fp;
  fp.batch = batch;
  fp.seqlen_q = seqlen_q;
  fp.seqlen_k = seqlen_k;
  fp.heads_q = heads_q;
  fp.heads_k = heads_k;
  fp.head_dim = D;
  fp.dtype = dtype;
  flashjax::set_contiguous_strides(fp);
  fp.softmax_scale = 1.f / std::sqrt(static_cast<float>(D));
  fp.softcap = softcap;
  fp.window_left = window_left;
  fp.window_right = window_right;
  return fp;
}

// Element counts of q / o, k / v and lse.
struct Sizes {
  int64_t q, k, lse;
};

Sizes sizes_of(const FwdParams& fp) {
  return {int64_t(fp.batch) * fp.seqlen_q * fp.heads_q * fp.head_dim,
          int64_t(fp.batch) * fp.seqlen_k * fp.heads_k * fp.head_dim, int64_t(fp.batch) * fp.heads_q * fp.seqlen_q};
}

template <typename Params>
void launch_and_wait(const KernelEntry& entry, const Params& params, cudaStream_t stream, const char* pass) {
  CUDA_CHECK(cudaDeviceSynchronize());  // fills done: the sanitizer attributes anything later to our kernels
  if (const cudaError_t err = launch(entry, params, stream); err != cudaSuccess) {
    throw Failure{std::string(pass) + " launch: " + cudaGetErrorString(err)};
  }
  if (const cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
    throw Failure{std::string(pass) + ": " + cudaGetErrorString(err)};
  }
}

// The forward: q, k, v (and sinks) random, o and lse poisoned, the family's choices as the handler writes them from
// the plan (num_splits: the count a lowering fixed), launched and waited for. fp's shape (and split workspace) set.
void run_forward(Arena& arena, FwdParams& fp, const KernelEntry& kernel, bool has_sinks, int num_splits,
                 uint64_t seed, cudaStream_t stream) {
  const Sizes n = sizes_of(fp);
  void* q = alloc_element(arena, n.q);
  void* k = alloc_element(arena, n.k);
  void* v = alloc_element(arena, n.k);
  float* sinks = has_sinks ? arena.alloc<float>(fp.heads_q) : nullptr;
  fill_element(q, n.q, fp.dtype, seed + 1);
  fill_element(k, n.k, fp.dtype, seed + 2);
  fill_element(v, n.k, fp.dtype, seed + 3);
  if (sinks != nullptr) fill(sinks, fp.heads_q, seed + 4);
  fp.q = q;
  fp.k = k;
  fp.v = v;
  fp.sinks = sinks;
  fp.o = alloc_element(arena, n.q);
  fp.lse = arena.alloc<float>(n.lse);
  poison(fp.o, 2 * n.q);
  poison(fp.lse, 4 * n.lse);
  flashjax::ChoiceQuery query;
  query.num_splits = num_splits;
  query.varlen = fp.cu_seqlens_q != nullptr;
  const flashjax::FamilyChoices choices = kernel.choices(fp, query);
  fp.tile_class = choices.tile_class;
  fp.pack_group = choices.pack_group;
  fp.num_splits = choices.num_splits;
  if (choices.varlen_tile_counter) {  // the run-time walk: the counter as the plan sizes it, poisoned
    fp.varlen_tile_counter = arena.alloc<int32_t>(flashjax::kVarlenTileCounterInts);
    poison(fp.varlen_tile_counter, 4 * flashjax::kVarlenTileCounterInts);
  }
  launch_and_wait(kernel, fp, stream, "forward");
}

// The backward after run_forward: its fields as the handlers fill them, dout (and dlse) random, the gradients and the
// workspace of `workspace`'s sizes (as Python sizes it) poisoned, launched and waited for. semaphores: the
// deterministic backward's counters (0: none).
// mask: the forward's bits again (a residual), with this pass's own tile classes.
BwdParams run_backward(Arena& arena, const FwdParams& fp, const KernelEntry& kernel,
                       const flashjax::BwdWorkspaceLayout& workspace, bool has_dlse, int64_t semaphores,
                       uint64_t seed, cudaStream_t stream, const HostMask* mask = nullptr) {
  const Sizes n = sizes_of(fp);
  BwdParams bp;
  static_cast<flashjax::AttnShape&>(bp) = fp;
  if (mask != nullptr && !mask->bits.empty()) attach_mask(arena, *mask, kernel, bp);
  bp.q = fp.q;
  bp.k = fp.k;
  bp.v = fp.v;
  bp.o = fp.o;
  bp.lse = fp.lse;
  bp.sinks = fp.sinks;
  void* dout = alloc_element(arena, n.q);
  float* dlse = has_dlse ? arena.alloc<float>(n.lse) : nullptr;
  fill_element(dout, n.q, fp.dtype, seed + 5);
  if (dlse != nullptr) fill(dlse, n.lse, seed + 6);
  bp.dout = dout;
  bp.dlse = dlse;
  bp.dq = alloc_element(arena, n.q);
  bp.dk = alloc_element(arena, n.k);
  bp.dv = alloc_element(arena, n.k);
  bp.dsinks = fp.sinks != nullptr ? arena.alloc<float>(fp.heads_q) : nullptr;
  bp.dq_accum = arena.alloc<float>(workspace.dq_accum);
  bp.dpsum = arena.alloc<float>(workspace.per_row);
  bp.lse_log2 = arena.alloc<float>(workspace.per_row);
  poison(bp.dq, 2 * n.q);
  poison(bp.dk, 2 * n.k);
  poison(bp.dv, 2 * n.k);
  if (bp.dsinks != nullptr) poison(bp.dsinks, 4 * fp.heads_q);
  poison(bp.dq_accum, 4 * workspace.dq_accum);
  poison(bp.dpsum, 4 * workspace.per_row);
  poison(bp.lse_log2, 4 * workspace.per_row);
  flashjax::set_gradient_strides(bp);
  bp.seqlen_q_rounded = workspace.seqlen_q_rounded;
  bp.deterministic = semaphores > 0;
  if (bp.deterministic) {
    bp.dq_semaphore = arena.alloc<int32_t>(semaphores);
    poison(bp.dq_semaphore, 4 * semaphores);  // the launcher zeroes them
  }
  launch_and_wait(kernel, bp, stream, "backward");
  return bp;
}

// The tangent after the forward fp ran (o, lse), dense or varlen: tangent_impl's fields from fp, random tangents for
// q, k, v (and sinks where fp has them), t_out and t_lse poisoned, launched on `kernel` and waited for. mask: the
// forward's bits again, with the tangent's own tile-class workspace (poisoned, sized for its tiles).
TangentParams run_tangent_pass(const FwdParams& fp, const KernelEntry& kernel, uint64_t seed, Arena& arena,
                               cudaStream_t stream, const HostMask* mask = nullptr) {
  const Sizes n = sizes_of(fp);
  TangentParams tp;
  static_cast<flashjax::AttnShape&>(tp) = fp;
  if (mask != nullptr && !mask->bits.empty()) attach_mask(arena, *mask, kernel, tp);
  tp.q = fp.q;
  tp.k = fp.k;
  tp.v = fp.v;
  tp.o = fp.o;
  tp.lse = fp.lse;
  tp.sinks = fp.sinks;
  void* tq = alloc_element(arena, n.q);
  void* tk = alloc_element(arena, n.k);
  void* tv = alloc_element(arena, n.k);
  fill_element(tq, n.q, fp.dtype, seed + 11);
  fill_element(tk, n.k, fp.dtype, seed + 12);
  fill_element(tv, n.k, fp.dtype, seed + 13);
  tp.tq = tq;
  tp.tk = tk;
  tp.tv = tv;
  if (fp.sinks != nullptr) {
    float* tsinks = arena.alloc<float>(fp.heads_q);
    fill(tsinks, fp.heads_q, seed + 14);
    tp.tsinks = tsinks;
  }
  tp.t_out = alloc_element(arena, n.q);
  tp.t_lse = arena.alloc<float>(n.lse);
  poison(tp.t_out, 2 * n.q);
  poison(tp.t_lse, 4 * n.lse);
  launch_and_wait(kernel, tp, stream, "tangent");
  return tp;
}

// The dense tangent, checked against float64 on the same rounded inputs (t_lse = sum_j P_j ts_j + P_sink t_sink,
// t_out = sum_j P_j (ts_j v_j + tv_j) - t_lse out, ts the score's tangent, j over the keys the band and the mask bits
// show), empty rows exactly t_out = 0 and t_lse = t_sink (0 without sinks).
TangentParams run_tangent(const Config& c, const Variant& variant, const FwdParams& fp, uint64_t seed, Arena& arena,
                          cudaStream_t stream, const HostMask& mask) {
  const int D = variant.head_dim;
  const DType dtype = variant.dtype;
  const Sizes sizes = sizes_of(fp);
  const int64_t n_q = sizes.q, n_k = sizes.k, n_lse = sizes.lse;
  const TangentParams tp = run_tangent_pass(fp, *variant.tangent, seed, arena, stream, &mask);
  const void *tq = tp.tq, *tk = tp.tk, *tv = tp.tv, *t_out = tp.t_out;
  const float *t_lse = tp.t_lse, *tsinks = tp.tsinks;

  const auto h = [&](const void* x, int64_t n) { return elements_to_host(x, n, dtype); };
  const std::vector<float> hq = h(fp.q, n_q), hk = h(fp.k, n_k), hv = h(fp.v, n_k), htq = h(tq, n_q),
                           htk = h(tk, n_k), htv = h(tv, n_k), hto = h(t_out, n_q);
  const std::vector<float> hto_lse = floats_to_host(t_lse, n_lse);
  const std::vector<float> hsinks = c.sinks ? floats_to_host(fp.sinks, c.heads_q) : std::vector<float>();
  const std::vector<float> htsinks = c.sinks ? floats_to_host(tsinks, c.heads_q) : std::vector<float>();
  expect_finite(hto, "t_out");
  expect_finite(hto_lse, "t_lse");
  const int group = c.heads_q / c.heads_k;
  double err2 = 0, ref2 = 0, lse_err2 = 0, lse_ref2 = 0;
  std::vector<double> s(static_cast<size_t>(c.seqlen_k)), ts(s.size()), acc(static_cast<size_t>(D)), out(acc.size());
  for (int b = 0; b < c.batch; ++b) {
    for (int hq_index = 0; hq_index < c.heads_q; ++hq_index) {
      const int hk_index = hq_index / group;
      for (int i = 0; i < c.seqlen_q; ++i) {
        const int64_t row = ((int64_t(b) * c.seqlen_q + i) * c.heads_q + hq_index) * D;
        const float got_lse = hto_lse[(int64_t(b) * c.heads_q + hq_index) * c.seqlen_q + i];
        const KeyRange keys = visible_keys(c, i);
        const double t_sink = c.sinks ? htsinks[hq_index] : 0.0;
        bool sees_a_key = false;
        for (int64_t j = keys.lo; j <= keys.hi && !sees_a_key; ++j) sees_a_key = mask.visible(b, hq_index, i, j);
        if (!sees_a_key) {
          for (int d = 0; d < D; ++d) {
            if (hto[row + d] != 0.f) throw Failure{"empty row: t_out " + std::to_string(hto[row + d]) + " not 0"};
          }
          if (!(std::abs(got_lse - t_sink) <= 1e-5 * std::max(1.0, std::abs(t_sink)))) {
            throw Failure{"empty row: t_lse " + std::to_string(got_lse) + " instead of " + std::to_string(t_sink)};
          }
          continue;
        }
        double m = c.sinks ? hsinks[hq_index] : -INFINITY;
        for (int64_t j = keys.lo; j <= keys.hi; ++j) {
          if (!mask.visible(b, hq_index, i, j)) continue;
          const int64_t krow = ((int64_t(b) * c.seqlen_k + j) * c.heads_k + hk_index) * D;
          double qk = 0, tqk = 0;
          for (int d = 0; d < D; ++d) {
            qk += double(hq[row + d]) * hk[krow + d];
            tqk += double(htq[row + d]) * hk[krow + d] + double(hq[row + d]) * htk[krow + d];
          }
          qk *= fp.softmax_scale;
          tqk *= fp.softmax_scale;
          const double t = c.softcap > 0.f ? std::tanh(qk / c.softcap) : 0.0;
          s[j] = c.softcap > 0.f ? c.softcap * t : qk;
          ts[j] = c.softcap > 0.f ? (1.0 - t * t) * tqk : tqk;
          m = std::max(m, s[j]);
        }
        double denom = c.sinks ? std::exp(hsinks[hq_index] - m) : 0.0;
        for (int64_t j = keys.lo; j <= keys.hi; ++j) {
          if (mask.visible(b, hq_index, i, j)) denom += std::exp(s[j] - m);
        }
        double want_lse = c.sinks ? std::exp(hsinks[hq_index] - m) / denom * t_sink : 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        std::fill(out.begin(), out.end(), 0.0);
        for (int64_t j = keys.lo; j <= keys.hi; ++j) {
          if (!mask.visible(b, hq_index, i, j)) continue;
          const int64_t vrow = ((int64_t(b) * c.seqlen_k + j) * c.heads_k + hk_index) * D;
          const double p = std::exp(s[j] - m) / denom;
          want_lse += p * ts[j];
          for (int d = 0; d < D; ++d) {
            acc[d] += p * (ts[j] * hv[vrow + d] + htv[vrow + d]);
            out[d] += p * hv[vrow + d];
          }
        }
        for (int d = 0; d < D; ++d) {
          const double want = acc[d] - want_lse * out[d];
          err2 += (hto[row + d] - want) * (hto[row + d] - want);
          ref2 += want * want;
        }
        lse_err2 += (got_lse - want_lse) * (got_lse - want_lse);
        lse_ref2 += want_lse * want_lse;
      }
    }
  }
  // The gradients' tolerances of tests/gpu/sweep.py: twice the forward's.
  const double tolerance = dtype == DType::kFloat16 ? 4e-3 : 2e-2;
  if (ref2 > 0 && std::sqrt(err2 / ref2) > tolerance) {
    throw Failure{"t_out differs from the float64 reference: relative error " + std::to_string(std::sqrt(err2 / ref2))};
  }
  if (lse_ref2 > 0 && std::sqrt(lse_err2 / lse_ref2) > tolerance) {
    throw Failure{"t_lse differs from the float64 reference: relative error " +
                  std::to_string(std::sqrt(lse_err2 / lse_ref2))};
  }
  return tp;
}

// The fused jvp (the forward and its tangent in one kernel) on the inputs and tangents of the forward and tangent
// passes that ran before it (both checked against float64): its out and t_out against theirs (relative error), its
// lse and t_lse row by row (the same infinities: empty rows' -inf lse), and every output written (they start as NaN).
void run_jvp(const Config& c, const Variant& variant, const FwdParams& fp, const TangentParams& tp, Arena& arena,
             cudaStream_t stream) {
  const Sizes n = sizes_of(fp);
  JvpParams jp;
  static_cast<flashjax::AttnShape&>(jp) = fp;
  jp.q = fp.q;
  jp.k = fp.k;
  jp.v = fp.v;
  jp.sinks = fp.sinks;
  jp.tq = tp.tq;
  jp.tk = tp.tk;
  jp.tv = tp.tv;
  jp.tsinks = tp.tsinks;
  jp.o = alloc_element(arena, n.q);
  jp.lse = arena.alloc<float>(n.lse);
  jp.t_out = alloc_element(arena, n.q);
  jp.t_lse = arena.alloc<float>(n.lse);
  poison(jp.o, 2 * n.q);
  poison(jp.lse, 4 * n.lse);
  poison(jp.t_out, 2 * n.q);
  poison(jp.t_lse, 4 * n.lse);
  launch_and_wait(*variant.jvp, jp, stream, "fused jvp");
  const double tolerance = variant.dtype == DType::kFloat16 ? 4e-3 : 2e-2;  // the tangent's
  const auto compare = [&](const std::vector<float>& got, const std::vector<float>& want, const char* name) {
    expect_finite(got, name);
    double err2 = 0, ref2 = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      err2 += double(got[i] - want[i]) * (got[i] - want[i]);
      ref2 += double(want[i]) * want[i];
    }
    if (ref2 > 0 && std::sqrt(err2 / ref2) > tolerance) {
      throw Failure{std::string("fused jvp: ") + name + " differs from the separate passes' by " +
                    std::to_string(std::sqrt(err2 / ref2))};
    }
  };
  compare(elements_to_host(jp.o, n.q, fp.dtype), elements_to_host(fp.o, n.q, fp.dtype), "out");
  compare(elements_to_host(jp.t_out, n.q, fp.dtype), elements_to_host(tp.t_out, n.q, fp.dtype), "t_out");
  const std::vector<float> lse = floats_to_host(jp.lse, n.lse), want_lse = floats_to_host(fp.lse, n.lse);
  const std::vector<float> t_lse = floats_to_host(jp.t_lse, n.lse), want_t_lse = floats_to_host(tp.t_lse, n.lse);
  expect_finite(t_lse, "fused jvp t_lse");
  for (int64_t i = 0; i < n.lse; ++i) {
    const bool same_lse = std::isinf(want_lse[i]) ? lse[i] == want_lse[i]
                                                   : std::abs(lse[i] - want_lse[i]) <= 1e-3f * std::max(1.f, std::abs(want_lse[i]));
    const bool same_t_lse = std::abs(t_lse[i] - want_t_lse[i]) <= 2e-2f * std::max(1.f, std::abs(want_t_lse[i]));
    if (!same_lse || !same_t_lse) {
      throw Failure{"fused jvp: row " + std::to_string(i) + " lse " + std::to_string(lse[i]) + " / " +
                    std::to_string(want_lse[i]) + ", t_lse " + std::to_string(t_lse[i]) + " / " +
                    std::to_string(want_t_lse[i])};
    }
  }
  (void)c;
}

void run_config(int index, const Config& c, const Variant& variant, cudaStream_t stream) {
  const int D = variant.head_dim;
  const DType dtype = variant.dtype;
  const uint64_t seed = 0x5A17u + 1000u * static_cast<uint64_t>(index);
  Arena arena;

  FwdParams fp = problem_params(c.batch, c.seqlen_q, c.seqlen_k, c.heads_q, c.heads_k, D, dtype, c.softcap,
                                c.window_left, c.window_right);
  const Sizes sizes = sizes_of(fp);
  const int64_t n_q = sizes.q, n_k = sizes.k, n_lse = sizes.lse;
  if (c.num_splits > 1) {  // the workspace as Python sizes it, poisoned: the combine must read only what parts wrote
    const flashjax::FwdSplitWorkspaceLayout split =
        flashjax::fwd_split_workspace_layout(c.batch, c.num_splits, c.heads_q, c.seqlen_q, D);
    fp.o_partial = arena.alloc<float>(split.o_partial);
    fp.lse_partial = arena.alloc<float>(split.lse_partial);
    poison(fp.o_partial, 4 * split.o_partial);
    poison(fp.lse_partial, 4 * split.lse_partial);
  }
  const HostMask mask = make_mask(c, seed);
  attach_mask(arena, mask, *variant.fwd, fp);
  run_forward(arena, fp, *variant.fwd, c.sinks, c.num_splits, seed, stream);
  if (variant.tangent != nullptr) {
    const TangentParams tp = run_tangent(c, variant, fp, seed, arena, stream, mask);
    if (variant.jvp != nullptr) run_jvp(c, variant, fp, tp, arena, stream);
  }
  const BwdParams bp = run_backward(
      arena, fp, *variant.bwd, flashjax::bwd_workspace_layout(c.batch, c.heads_q, c.seqlen_q, D), c.dlse,
      c.deterministic ? flashjax::bwd_dq_semaphores(c.batch, c.heads_q, c.seqlen_q) : 0, seed, stream, &mask);
  const void *q = fp.q, *k = fp.k, *v = fp.v, *o = fp.o, *dq = bp.dq, *dk = bp.dk, *dv = bp.dv;
  const float *lse = fp.lse, *sinks = fp.sinks, *dsinks = bp.dsinks;

  // ---- checks
  const std::vector<float> hq = elements_to_host(q, n_q, dtype), hk = elements_to_host(k, n_k, dtype),
                           hv = elements_to_host(v, n_k, dtype), ho = elements_to_host(o, n_q, dtype),
                           hdq = elements_to_host(dq, n_q, dtype), hdk = elements_to_host(dk, n_k, dtype),
                           hdv = elements_to_host(dv, n_k, dtype), hlse = floats_to_host(lse, n_lse);
  const std::vector<float> hsinks = c.sinks ? floats_to_host(sinks, c.heads_q) : std::vector<float>();
  const std::vector<float> hdsinks = c.sinks ? floats_to_host(dsinks, c.heads_q) : std::vector<float>();
  expect_finite(ho, "out");
  expect_finite(hdq, "dq");
  expect_finite(hdk, "dk");
  expect_finite(hdv, "dv");
  expect_finite(hdsinks, "dsinks");

  // Forward against float64 on the same rounded inputs; empty rows exactly out = 0, dq = 0 and lse = -inf / sink.
  const int group = c.heads_q / c.heads_k;
  double err2 = 0, ref2 = 0, lse_err = 0;
  std::vector<double> scores(static_cast<size_t>(c.seqlen_k)), acc(static_cast<size_t>(D));
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads_q; ++h) {
      const int hk_index = h / group;
      for (int i = 0; i < c.seqlen_q; ++i) {
        const int64_t row = ((int64_t(b) * c.seqlen_q + i) * c.heads_q + h) * D;
        const float got_lse = hlse[(int64_t(b) * c.heads_q + h) * c.seqlen_q + i];
        const KeyRange keys = visible_keys(c, i);
        bool sees_a_key = false;
        for (int64_t j = keys.lo; j <= keys.hi && !sees_a_key; ++j) sees_a_key = mask.visible(b, h, i, j);
        if (!sees_a_key) {
          for (int d = 0; d < D; ++d) {
            if (ho[row + d] != 0.f || hdq[row + d] != 0.f) {
              throw Failure{"empty row b" + std::to_string(b) + " h" + std::to_string(h) + " i" +
                            std::to_string(i) + ": out " + std::to_string(ho[row + d]) + ", dq " +
                            std::to_string(hdq[row + d]) + " instead of 0"};
            }
          }
          // With sinks the denominator is exp(sink) alone; the kernel's log2-domain round trip may move it an ulp.
          const float want = c.sinks ? hsinks[h] : -INFINITY;
          if (c.sinks ? !(std::abs(got_lse - want) <= 1e-5f * std::max(1.f, std::abs(want))) : got_lse != want) {
            throw Failure{"empty row b" + std::to_string(b) + " h" + std::to_string(h) + " i" + std::to_string(i) +
                          ": lse " + std::to_string(got_lse) + " instead of " + std::to_string(want)};
          }
          continue;
        }
        double m = c.sinks ? hsinks[h] : -INFINITY;
        for (int64_t j = keys.lo; j <= keys.hi; ++j) {
          if (!mask.visible(b, h, i, j)) continue;
          const int64_t krow = ((int64_t(b) * c.seqlen_k + j) * c.heads_k + hk_index) * D;
          double s = 0;
          for (int d = 0; d < D; ++d) s += double(hq[row + d]) * hk[krow + d];
          s *= fp.softmax_scale;
          if (c.softcap > 0.f) s = c.softcap * std::tanh(s / c.softcap);
          scores[j] = s;
          m = std::max(m, s);
        }
        double denom = c.sinks ? std::exp(hsinks[h] - m) : 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = keys.lo; j <= keys.hi; ++j) {
          if (!mask.visible(b, h, i, j)) continue;
          const int64_t vrow = ((int64_t(b) * c.seqlen_k + j) * c.heads_k + hk_index) * D;
          const double p = std::exp(scores[j] - m);
          denom += p;
          for (int d = 0; d < D; ++d) acc[d] += p * hv[vrow + d];
        }
        for (int d = 0; d < D; ++d) {
          const double want = acc[d] / denom;
          err2 += (ho[row + d] - want) * (ho[row + d] - want);
          ref2 += want * want;
        }
        const double want_lse = m + std::log(denom);
        if (!std::isfinite(got_lse)) {
          throw Failure{"lse of row b" + std::to_string(b) + " h" + std::to_string(h) + " i" + std::to_string(i) +
                        " is " + std::to_string(got_lse) + ", the row sees keys " + std::to_string(keys.lo) +
                        ".." + std::to_string(keys.hi)};
        }
        lse_err = std::max(lse_err, std::abs(got_lse - want_lse) / std::max(1.0, std::abs(want_lse)));
      }
    }
  }
  // Relative-norm tolerances of tests/gpu/sweep.py (bf16 1e-2, fp16 2e-3); lse is f32 throughout.
  const double tolerance = dtype == DType::kFloat16 ? 2e-3 : 1e-2;
  if (ref2 > 0 && std::sqrt(err2 / ref2) > tolerance) {
    throw Failure{"out differs from the float64 reference: relative error " + std::to_string(std::sqrt(err2 / ref2))};
  }
  if (lse_err > 1e-3) throw Failure{"lse differs from the float64 reference by " + std::to_string(lse_err)};

  // Keys that no query row of their KV head's group sees (band and mask bits) get no gradient.
  std::vector<bool> seen(static_cast<size_t>(c.batch) * c.heads_k * c.seqlen_k, false);
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.heads_q; ++h) {
      for (int i = 0; i < c.seqlen_q; ++i) {
        const KeyRange keys = visible_keys(c, i);
        for (int64_t j = keys.lo; j <= keys.hi; ++j) {
          if (mask.visible(b, h, i, j)) seen[(size_t(b) * c.heads_k + h / group) * c.seqlen_k + j] = true;
        }
      }
    }
  }
  for (int b = 0; b < c.batch; ++b) {
    for (int j = 0; j < c.seqlen_k; ++j) {
      for (int h = 0; h < c.heads_k; ++h) {
        if (seen[(size_t(b) * c.heads_k + h) * c.seqlen_k + j]) continue;
        const int64_t krow = ((int64_t(b) * c.seqlen_k + j) * c.heads_k + h) * D;
        for (int d = 0; d < D; ++d) {
          if (hdk[krow + d] != 0.f || hdv[krow + d] != 0.f) {
            throw Failure{"key b" + std::to_string(b) + " j" + std::to_string(j) + " h" + std::to_string(h) +
                          " is seen by no row but has dk " + std::to_string(hdk[krow + d]) + ", dv " +
                          std::to_string(hdv[krow + d])};
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- varlen configs
// Packed sequences (docs/design.md §2.7), forward then backward, on the kernels dispatch picks for varlen (on Hopper
// the sm90 family both ways; elsewhere, or with FLASHJAX_DISABLE_FAMILIES=sm90, the sm80 family), with the FFI
// handlers' fields and bwd_varlen_workspace_layout's workspace (poisoned). The
// offsets and seqused are device data the kernels clamp: malformed ones (decreasing, negative, past the end, not from
// zero, 2^31 - 1) must run memcheck-clean with finite results. Well-formed ones also check the zeros §2.5 / §2.7
// promise: rows no sequence uses get out = 0, lse = -inf and dq = 0, keys no sequence uses dk = dv = 0.
struct VarlenConfig {
  std::vector<int32_t> cu_q, cu_k;
  std::vector<int32_t> used;  // seqused_q and seqused_k; empty: none
  int total_q, total_k, heads_q, heads_k;
  int window_left, window_right;
  bool sinks, dlse, well_formed;
  float softcap;
  const char* what;
  // A mask mod (issue 38): random bits over the N sequences padded to mask_rows x mask_keys (the max_seqlen hints,
  // flashjax/mask_grid.h), shared, per sequence, or per sequence and query head; a grid smaller than a sequence
  // (a wrong hint under jit) cuts it.
  Config::MaskBits mask = Config::kNoMask;
  int mask_rows = 0, mask_keys = 0;
};

constexpr int32_t kMax = INT32_MAX;
const VarlenConfig kVarlenConfigs[] = {
    {{0, 0, 3, 130, 131}, {0, 5, 5, 300, 301}, {}, 140, 310, 4, 2, -1, 0, true, true, true, 0.f,
     "varlen: empty and tiny sequences, q and k packed differently, padding tokens, causal, sinks, dlse"},
    {{0, 1, 2, 3}, {0, 700, 1000, 2900}, {1, 0, 1}, 3, 3000, 8, 2, -1, -1, false, false, true, 0.f,
     "varlen decode: one query per sequence against long keys, seqused"},
    {{0, 300, 301, 700}, {0, 260, 500, 940}, {250, 1, 399}, 750, 950, 4, 1, 32, 7, true, true, true, 5.f,
     "varlen: window (32, 7), softcap 5, MQA 4/1, seqused, sinks, dlse"},
    {{0, 40, 20, 90}, {90, 20, 40, 0}, {}, 90, 120, 4, 2, -1, 0, true, false, false, 0.f,
     "varlen: decreasing offsets, causal, sinks"},
    {{-50, 10, -3, 90}, {17, 40, 5000, 80}, {kMax, -5, 7}, 90, 120, 4, 2, -1, -1, false, true, false, 0.f,
     "varlen: negative, past-the-end and not-from-zero offsets, seqused out of range, dlse"},
    {{0, kMax, kMax, kMax}, {0, kMax, kMax, kMax}, {}, 90, 120, 4, 2, -1, 0, true, true, false, 30.f,
     "varlen: 2^31 - 1 offsets, causal, softcap 30, sinks, dlse"},
    {{17, 40, 60, 80}, {0, kMax, -7, 120}, {3, kMax, 0}, 90, 120, 4, 2, 16, 3, true, true, false, 0.f,
     "varlen: not from zero, 2^31 - 1 and negative key offsets, window (16, 3)"},
    // The sm90 forward's tiles start at each sequence's first row: lengths around its 64-row warpgroups and 128-row
    // tiles (63, 64, 65, 128, 129), keys packed differently, padding on both sides; then two long sequences around an
    // empty one, seqused inside both, GQA 8/2.
    {{0, 63, 127, 192, 320, 449}, {0, 129, 257, 322, 386, 449}, {}, 460, 470, 4, 2, -1, 0, true, true, true, 0.f,
     "varlen: lengths 63, 64, 65, 128, 129 (sm90 tile boundaries), causal, sinks, dlse"},
    {{0, 700, 700, 1400}, {0, 800, 800, 1700}, {650, 0, 699}, 1400, 1710, 8, 2, -1, -1, false, true, true, 0.f,
     "varlen: long, empty, long sequences with seqused inside, GQA 8/2, dlse"},
    // The sm90 backward's CTAs own 64 keys at D 192 / 256 and 128 below, each K / V box from its sequence's first
    // key, and step over 64-row Q / dO boxes: key lengths around both blocks, queries packed differently, seqused
    // inside the last blocks (their boxes' rows past it are zeroed in shared memory), padding behind the last box.
    // In the rotation over the widths these two take fp16 D 192 and bf16 D 64 (available_variants' order).
    {{0, 63, 127, 192, 192, 320, 449}, {0, 65, 194, 257, 257, 321, 448}, {60, 64, 63, 0, 64, 127}, 460, 470, 4, 2,
     -1, 0, true, true, true, 0.f,
     "varlen: keys 65, 129, 63, 0, 64, 127 (sm90 backward's 64-key blocks), seqused inside, causal, sinks, dlse"},
    {{0, 129, 130, 330, 394, 457}, {0, 127, 255, 384, 641, 642}, {}, 470, 700, 8, 1, 100, 20, false, true, true,
     10.f, "varlen: keys 127, 128, 129, 257, 1 (sm90 backward's 128-key blocks), MQA 8/1, window (100, 20), "
     "softcap 10, dlse"},
    // Decode-shaped calls pack GQA on the sm90 forward (fwd_choices.cuh: mean query length 1): 16 sequences of one
    // query against 2k..8k keys at GQA 4:1 (one tile per (sequence, KV head), its 4 query heads as rows), causal,
    // sinks; then the same packing with decreasing offsets.
    {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
     {0, 2000, 4411, 7233, 10466, 14110, 18165, 22631, 27508, 32796, 38495, 44605, 51126, 58058, 65401, 73155,
      81320},
     {}, 16, 81400, 8, 2, -1, 0, true, true, true, 0.f,
     "varlen decode: GQA 4/1 packed, 16 sequences of one query against 2k..8k keys, causal, sinks, dlse"},
    {{0, 2, 1, 3, 4}, {0, 900, 400, 2000, 1900}, {1, 3, 0, 1}, 6, 2100, 8, 2, -1, -1, false, false, false, 0.f,
     "varlen decode: GQA 4/1 packed, decreasing offsets, seqused out of range"},
    // Varlen with a mask mod (the sm80 kernels on every device): bits [N or 1, Hq or 1, max_q, ceil(max_k / 32)]
    // built from empty, full and random 32 x 32 blocks, indexed by each sequence's local rows and keys; the grid as
    // large as the longest sequence, larger (a hint with slack), and smaller (a hint too small: rows and keys past it
    // are cut, never read from the bits); malformed offsets with bits.
    {{0, 0, 3, 130, 331}, {0, 5, 5, 300, 517}, {}, 340, 520, 4, 2, -1, 0, true, true, true, 0.f,
     "varlen mask bits per sequence: empty and tiny sequences, packed differently, causal, sinks, dlse",
     Config::kMaskPerBatch, 201, 295},
    {{0, 300, 301, 700}, {0, 260, 500, 940}, {250, 1, 399}, 750, 950, 4, 1, 32, 7, true, true, true, 5.f,
     "varlen mask bits per sequence and head: window (32, 7), softcap 5, MQA 4/1, seqused, sinks, dlse",
     Config::kMaskPerHead, 450, 500},
    {{0, 1, 2, 3}, {0, 700, 1000, 2900}, {1, 0, 1}, 3, 3000, 8, 2, -1, -1, false, false, true, 0.f,
     "varlen mask bits shared: decode against long keys, seqused", Config::kMaskShared, 1, 1900},
    {{0, 130, 131, 400}, {0, 100, 300, 517}, {}, 400, 520, 4, 2, -1, -1, true, true, true, 0.f,
     "varlen mask bits over a grid smaller than the sequences (hints 70 x 90): cut, sinks, dlse",
     Config::kMaskPerBatch, 70, 90},
    {{0, 40, 20, 90}, {90, 20, 40, 0}, {}, 90, 120, 4, 2, -1, 0, true, true, false, 0.f,
     "varlen mask bits per head: decreasing offsets, causal, sinks, dlse", Config::kMaskPerHead, 40, 50},
    {{-50, 10, -3, 90}, {17, 40, 5000, 80}, {kMax, -5, 7}, 90, 120, 4, 2, 16, 3, false, true, false, 0.f,
     "varlen mask bits per sequence: negative, past-the-end offsets, seqused out of range, window (16, 3)",
     Config::kMaskPerBatch, 64, 64},
    {{0, kMax, kMax, kMax}, {0, kMax, kMax, kMax}, {}, 90, 120, 4, 2, -1, 0, true, true, false, 30.f,
     "varlen mask bits shared: 2^31 - 1 offsets, causal, softcap 30, sinks, dlse", Config::kMaskShared, 90, 120},
};
constexpr int kNumVarlenConfigs = sizeof(kVarlenConfigs) / sizeof(kVarlenConfigs[0]);

int32_t* upload(Arena& arena, const std::vector<int32_t>& values) {
  int32_t* dev = arena.alloc<int32_t>(static_cast<int64_t>(values.size()));
  if (!values.empty()) {
    CUDA_CHECK(cudaMemcpy(dev, values.data(), sizeof(int32_t) * values.size(), cudaMemcpyHostToDevice));
  }
  return dev;
}

// Rows [0, total) that no sequence uses, from well-formed offsets. A config marked well formed whose seqused runs
// past its sequence is the table's mistake, and says so instead of writing past the vector.
std::vector<bool> unused_rows(const std::vector<int32_t>& cu, const std::vector<int32_t>& used, int total) {
  std::vector<bool> unused(static_cast<size_t>(total), true);
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int end = used.empty() ? cu[b + 1] : cu[b] + used[b];
    if (cu[b] < 0 || end > cu[b + 1] || cu[b + 1] > total) {
      throw Failure{"config marked well formed has sequence " + std::to_string(b) + " rows [" +
                    std::to_string(cu[b]) + ", " + std::to_string(end) + ") outside [" + std::to_string(cu[b]) +
                    ", " + std::to_string(cu[b + 1]) + ") or past " + std::to_string(total)};
    }
    for (int r = cu[b]; r < end; ++r) unused[r] = false;
  }
  return unused;
}

void run_varlen_config(int index, const VarlenConfig& c, const Variant& variant, cudaStream_t stream) {
  const int D = variant.head_dim;
  const uint64_t seed = 0x7A11u + 1000u * static_cast<uint64_t>(index);
  const int n = static_cast<int>(c.cu_q.size()) - 1;
  Arena arena;

  // One batch of Tq / Tk rows, lse [Hq, Tq], the offsets on the device (fill_varlen_shape's fields).
  FwdParams fp = problem_params(1, c.total_q, c.total_k, c.heads_q, c.heads_k, D, variant.dtype, c.softcap,
                                c.window_left, c.window_right);
  fp.lse_batch_stride = 0;
  fp.num_seqs = n;
  fp.cu_seqlens_q = upload(arena, c.cu_q);
  fp.cu_seqlens_k = upload(arena, c.cu_k);
  fp.seqused_q = fp.seqused_k = c.used.empty() ? nullptr : upload(arena, c.used);
  Config grid{};  // the bits' padded grid as a dense problem, for make_mask
  grid.batch = n;
  grid.heads_q = c.heads_q;
  grid.seqlen_q = c.mask_rows;
  grid.seqlen_k = c.mask_keys;
  grid.mask = c.mask;
  const HostMask mask = make_mask(grid, seed);
  attach_mask(arena, mask, *variant.fwd, fp);
  run_forward(arena, fp, *variant.fwd, c.sinks, 1, seed, stream);
  const BwdParams bp = run_backward(arena, fp, *variant.bwd,
                                    flashjax::bwd_varlen_workspace_layout(c.total_q, n, c.heads_q, D), c.dlse,
                                    /*semaphores=*/0, seed, stream, &mask);
  const DType dtype = variant.dtype;
  const Sizes sizes = sizes_of(fp);
  const int64_t n_q = sizes.q, n_k = sizes.k, n_lse = sizes.lse;
  std::vector<float> ht_out, ht_lse;  // the tangent's, where this build has a varlen tangent kernel
  if (variant.tangent != nullptr) {
    const TangentParams tp = run_tangent_pass(fp, *variant.tangent, seed, arena, stream);
    ht_out = elements_to_host(tp.t_out, n_q, dtype);
    ht_lse = floats_to_host(tp.t_lse, n_lse);
    expect_finite(ht_out, "t_out");
    expect_finite(ht_lse, "t_lse");
  }
  const void *o = fp.o, *dq = bp.dq, *dk = bp.dk, *dv = bp.dv;
  const float *lse = fp.lse, *dsinks = bp.dsinks;

  // ---- checks: finite everywhere (lse may be -inf: rows that see no key), zeros where no sequence is.
  const std::vector<float> ho = elements_to_host(o, n_q, dtype), hdq = elements_to_host(dq, n_q, dtype),
                           hdk = elements_to_host(dk, n_k, dtype), hdv = elements_to_host(dv, n_k, dtype),
                           hlse = floats_to_host(lse, n_lse);
  expect_finite(ho, "out");
  expect_finite(hdq, "dq");
  expect_finite(hdk, "dk");
  expect_finite(hdv, "dv");
  if (c.sinks) expect_finite(floats_to_host(dsinks, c.heads_q), "dsinks");
  for (int64_t i = 0; i < n_lse; ++i) {
    if (std::isnan(hlse[i]) || hlse[i] == INFINITY) {
      throw Failure{"lse[" + std::to_string(i) + "] = " + std::to_string(hlse[i])};
    }
  }
  if (!c.well_formed) return;
  const std::vector<bool> rows_q = unused_rows(c.cu_q, c.used, c.total_q);
  const std::vector<bool> rows_k = unused_rows(c.cu_k, c.used, c.total_k);
  for (int r = 0; r < c.total_q; ++r) {
    if (!rows_q[r]) continue;
    for (int h = 0; h < c.heads_q; ++h) {
      if (!ht_lse.empty() && ht_lse[int64_t(h) * c.total_q + r] != 0.f) {
        throw Failure{"unused query row " + std::to_string(r) + " has t_lse " +
                      std::to_string(ht_lse[int64_t(h) * c.total_q + r]) + " instead of 0"};
      }
      if (hlse[int64_t(h) * c.total_q + r] != -INFINITY) {
        throw Failure{"unused query row " + std::to_string(r) + " has lse " +
                      std::to_string(hlse[int64_t(h) * c.total_q + r]) + " instead of -inf"};
      }
      for (int d = 0; d < D; ++d) {
        const int64_t at = (int64_t(r) * c.heads_q + h) * D + d;
        if (ho[at] != 0.f || hdq[at] != 0.f || (!ht_out.empty() && ht_out[at] != 0.f)) {
          throw Failure{"unused query row " + std::to_string(r) + ": out " + std::to_string(ho[at]) + ", dq " +
                        std::to_string(hdq[at]) + (ht_out.empty() ? "" : ", t_out " + std::to_string(ht_out[at])) +
                        " instead of 0"};
        }
      }
    }
  }
  for (int r = 0; r < c.total_k; ++r) {
    if (!rows_k[r]) continue;
    for (int64_t i = int64_t(r) * c.heads_k * D; i < int64_t(r + 1) * c.heads_k * D; ++i) {
      if (hdk[i] != 0.f || hdv[i] != 0.f) {
        throw Failure{"unused key row " + std::to_string(r) + ": dk " + std::to_string(hdk[i]) + ", dv " +
                      std::to_string(hdv[i]) + " instead of 0"};
      }
    }
  }
}

// The (dtype, head dim) pairs with a forward and a backward kernel for this device, in an order that alternates
// dtypes and widths so that consecutive configs differ in both. Dispatch is asked as the FFI handlers ask it: with
// the device's own opt-in shared memory per block (capped by FLASHJAX_SMEM_LIMIT_KB).
std::vector<Variant> available_variants(int device_sm, int smem_per_block_optin, std::string* reason) {
  const std::vector<std::pair<DType, int>> order = {
      {DType::kBFloat16, 64},  {DType::kFloat16, 128}, {DType::kBFloat16, 256}, {DType::kFloat16, 96},
      {DType::kBFloat16, 192}, {DType::kFloat16, 64},  {DType::kBFloat16, 128}, {DType::kFloat16, 256},
      {DType::kBFloat16, 96},  {DType::kFloat16, 192}};
  std::vector<Variant> variants;
  for (const auto& [dtype, head_dim] : order) {
    flashjax::ProblemKey key;
    key.dtype = dtype;
    key.head_dim = head_dim;
    key.direction = flashjax::Direction::kFwd;
    const flashjax::Choice fwd = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                         flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kBwd;
    const flashjax::Choice bwd = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                         flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kTangent;
    const flashjax::Choice tangent = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                             flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kJvp;
    const flashjax::Choice jvp = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                         flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kBwd;
    key.varlen = true;  // the varlen configs' kernels (the rows that take packed sequences: gen_kernels.py's VARLEN)
    const flashjax::Choice varlen_bwd = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                                flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kFwd;
    const flashjax::Choice varlen_fwd = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                                flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kTangent;
    const flashjax::Choice varlen_tangent = flashjax::choose_kernel(
        device_sm, flashjax::compiled_archs(), key, flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.varlen = false;
    key.mask_mod = true;  // the mask-mod configs' kernels (the sm90 family's on Hopper, the sm80 family's elsewhere)
    key.direction = flashjax::Direction::kFwd;
    const flashjax::Choice mask_fwd = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                              flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kBwd;
    const flashjax::Choice mask_bwd = flashjax::choose_kernel(device_sm, flashjax::compiled_archs(), key,
                                                              flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kTangent;
    const flashjax::Choice mask_tangent = flashjax::choose_kernel(
        device_sm, flashjax::compiled_archs(), key, flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kBwd;
    key.varlen = true;  // the varlen mask-mod configs' kernels (gen_kernels.py's VARLEN_MASK_MOD: sm80)
    const flashjax::Choice varlen_mask_bwd = flashjax::choose_kernel(
        device_sm, flashjax::compiled_archs(), key, flashjax::enabled_kernel_table(), smem_per_block_optin);
    key.direction = flashjax::Direction::kFwd;
    const flashjax::Choice varlen_mask_fwd = flashjax::choose_kernel(
        device_sm, flashjax::compiled_archs(), key, flashjax::enabled_kernel_table(), smem_per_block_optin);
    if (fwd.kernel != nullptr && bwd.kernel != nullptr) {
      variants.push_back({dtype, head_dim, fwd.kernel, bwd.kernel, varlen_fwd.kernel, varlen_bwd.kernel,
                          tangent.kernel, varlen_tangent.kernel, mask_fwd.kernel, mask_bwd.kernel,
                          mask_tangent.kernel, varlen_mask_fwd.kernel, varlen_mask_bwd.kernel, jvp.kernel});
    } else if (reason->empty()) {
      *reason = fwd.kernel == nullptr ? fwd.reason : bwd.reason;
    }
  }
  return variants;
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--list] [--only N]...\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> only;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--list") {
      for (int i = 0; i < kNumConfigs; ++i) {
        std::printf("[%d] %s  (%s)\n", i, describe(kConfigs[i]).c_str(), kConfigs[i].what);
      }
      for (int j = 0; j < kNumVarlenConfigs; ++j) std::printf("[%d] %s\n", kNumConfigs + j, kVarlenConfigs[j].what);
      return 0;
    }
    if (arg == "--only" && a + 1 < argc) {
      char* end = nullptr;
      const long n = std::strtol(argv[++a], &end, 10);
      if (*end != '\0' || n < 0 || n >= kNumConfigs + kNumVarlenConfigs) return usage(argv[0]);
      only.push_back(static_cast<int>(n));
      continue;
    }
    return usage(argv[0]);
  }

  int device = 0, major = 0, minor = 0, smem_per_block_optin = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem_per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    std::printf("flashjax_sanitize: no CUDA device: FAILED\n");
    return 1;
  }
  const int device_sm = major * 10 + minor;
  // As the FFI handlers read it: capped by FLASHJAX_SMEM_LIMIT_KB where set (the 99 KB parts' tiles on a larger GPU).
  smem_per_block_optin = flashjax::dispatch_smem_limit(device_sm, smem_per_block_optin);
  const char* disabled = std::getenv("FLASHJAX_DISABLE_FAMILIES");
  std::string archs;
  for (const std::string& arch : flashjax::compiled_archs()) archs += (archs.empty() ? "" : ",") + arch;
  std::printf("flashjax_sanitize: %s (sm_%d, %d bytes of shared memory per block for dispatch), built for %s, %zu of "
              "%zu kernels enabled (FLASHJAX_DISABLE_FAMILIES=%s)\n",
              prop.name, device_sm, smem_per_block_optin, archs.c_str(), flashjax::enabled_kernel_table().size(),
              flashjax::kernel_table().size(), disabled != nullptr ? disabled : "");

  std::string reason;
  const std::vector<Variant> variants = available_variants(device_sm, smem_per_block_optin, &reason);
  if (variants.empty()) {
    std::printf("flashjax_sanitize: no kernel runs here: %s: FAILED\n", reason.c_str());
    return 1;
  }

  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::printf("flashjax_sanitize: cudaStreamCreate failed: FAILED\n");
    return 1;
  }
  int failures = 0;
  // Runs one config; false when a sticky error (an illegal address, a trap) leaves the context unusable, so that the
  // later configs cannot run.
  auto attempt = [&](int i, auto&& run) {
    std::fflush(stdout);
    try {
      run();
      std::printf(": ok\n");
    } catch (const Failure& failure) {
      std::printf(": FAILED %s\n", failure.why.c_str());
      ++failures;
      if (cudaDeviceSynchronize() != cudaSuccess) {
        std::printf("flashjax_sanitize: the CUDA context is unusable after config %d; stopping\n", i);
        return false;
      }
    }
    std::fflush(stdout);
    return true;
  };
  for (int i = 0; i < kNumConfigs; ++i) {
    if (!only.empty() && std::find(only.begin(), only.end(), i) == only.end()) continue;
    const Variant* pinned = nullptr;
    for (const Variant& v : variants) {
      if (pinned == nullptr && v.head_dim == kConfigs[i].head_dim) pinned = &v;
    }
    if (kConfigs[i].head_dim > 0 && pinned == nullptr) continue;  // not compiled in this build
    Variant variant = pinned != nullptr ? *pinned : variants[i % variants.size()];
    if (kConfigs[i].deterministic && !variant.bwd->deterministic) continue;  // e.g. the sm80 backward (sm80 mode)
    if (kConfigs[i].mask != Config::kNoMask) {  // the mask-mod kernels (the tangent's where this build has one)
      if (variant.mask_fwd == nullptr || variant.mask_bwd == nullptr) continue;
      variant.fwd = variant.mask_fwd;
      variant.bwd = variant.mask_bwd;
      variant.tangent = variant.mask_tangent;
      variant.jvp = nullptr;  // the fused jvp takes no mask mod
    }
    std::printf("[%d] %s %s D%d fwd %s bwd %s tangent %s jvp %s", i, describe(kConfigs[i]).c_str(),
                dtype_name(variant.dtype), variant.head_dim, variant.fwd->family, variant.bwd->family,
                variant.tangent != nullptr ? variant.tangent->family : "none",
                variant.jvp != nullptr ? variant.jvp->family : "none");
    if (!attempt(i, [&] { run_config(i, kConfigs[i], variant, stream); })) return 1;
  }
  // The varlen configs rotate over the widths too (each width's 99 KB row where FLASHJAX_SMEM_LIMIT_KB=99 says so).
  for (int j = 0; j < kNumVarlenConfigs; ++j) {
    const int i = kNumConfigs + j;
    if (!only.empty() && std::find(only.begin(), only.end(), i) == only.end()) continue;
    const Variant& variant = variants[j % variants.size()];
    const bool masked = kVarlenConfigs[j].mask != Config::kNoMask;  // no tangent takes a mask mod with varlen
    const KernelEntry* fwd = masked ? variant.varlen_mask_fwd : variant.varlen_fwd;
    const KernelEntry* bwd = masked ? variant.varlen_mask_bwd : variant.varlen_bwd;
    if (fwd == nullptr || bwd == nullptr) continue;  // no sm80 family in this build
    const Variant varlen{variant.dtype, variant.head_dim, fwd, bwd, nullptr, nullptr,
                         masked ? nullptr : variant.varlen_tangent, nullptr};
    std::printf("[%d] %s %s D%d fwd %s bwd %s tangent %s", i, kVarlenConfigs[j].what, dtype_name(variant.dtype),
                variant.head_dim, varlen.fwd->family, varlen.bwd->family,
                varlen.tangent != nullptr ? varlen.tangent->family : "none");
    if (!attempt(i, [&] { run_varlen_config(i, kVarlenConfigs[j], varlen, stream); })) return 1;
  }
  cudaStreamDestroy(stream);
  std::printf("flashjax_sanitize: %d config(s) failed\n", failures);
  return failures == 0 ? 0 : 1;
}

// Issue 37 lab: the sm90 varlen backward (run_bwd with cu_seqlens set: BwdKernelSm90<..., kVarlen>) outside JAX,
// against a CPU reference in double, on random packings, with a watchdog: a launch that does not finish in 10 s
// prints HANG with its config and exits 3 (a named-barrier or pipeline mismatch deadlocks the CTA). Per config: N
// sequences of random lengths (many empty and tiny, many around the 64-row query blocks and the 64 / 128-key
// blocks: 63, 64, 65, 127, 128, 129), q and k packed differently, padding tokens, seqused, GQA, causal / window,
// sinks (dsinks), softcap, the lse cotangent. Tokens no sequence uses hold NaN in q, k, v, o, dO and dlse, and every
// output and workspace buffer starts as NaN: the kernels must neither read the former into a sequence nor leave
// the latter unwritten (the launcher zeroes dq / dk / dv, the row pass the workspace). One width per binary:
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -lineinfo -Icsrc -Icsrc/include \
//     -isystem <cutlass>/include -DSWEEP_D=128 [-DSWEEP_FP16] lab/experiments/sm90_bwd_varlen_sweep.cu -o /tmp/bs128
//   /tmp/bs128 [configs [first_seed]]      random configs (default 100 from seed 0); SWEEP_DETAIL=1 per sequence
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flashjax/workspace.h"
#include "kernels/sm90/bwd_launch.cuh"

#ifndef SWEEP_D
#define SWEEP_D 128
#endif

namespace {

#if defined(SWEEP_FP16)
using Element = cutlass::half_t;
constexpr double kTol = 4e-3;  // twice tests/gpu/sweep.py's fp16 tolerance, as test_varlen.py gives gradients
#else
using Element = cutlass::bfloat16_t;
constexpr double kTol = 2e-2;
#endif
constexpr int D = SWEEP_D;

struct Config {
  int seed, hq, hk;
  bool causal, sinks, seqused, dlse;
  int window_left, window_right;
  float softcap;
  std::vector<int> lq, lk, used_q, used_k;
  int pad_q, pad_k;
  std::string describe() const {
    std::string s = "seed " + std::to_string(seed) + " D " + std::to_string(D) + " h " + std::to_string(hq) + "/" +
                    std::to_string(hk) + " win (" + std::to_string(window_left) + "," +
                    std::to_string(window_right) + ")" + (sinks ? " sinks" : "") + (softcap > 0 ? " softcap" : "") +
                    (dlse ? " dlse" : "") + " pad " + std::to_string(pad_q) + "/" + std::to_string(pad_k) +
                    " lq/lk(used):";
    for (size_t b = 0; b < lq.size(); ++b) {
      s += " " + std::to_string(lq[b]) + "/" + std::to_string(lk[b]);
      if (seqused) s += "(" + std::to_string(used_q[b]) + "/" + std::to_string(used_k[b]) + ")";
    }
    return s;
  }
};

Config random_config(int seed) {
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Config c;
  c.seed = seed;
  const int groups[] = {1, 1, 2, 4};
  c.hk = uniform(1, 2);
  c.hq = c.hk * groups[uniform(0, 3)];
  const int mask = uniform(0, 3);
  c.causal = mask == 1;
  c.window_left = mask == 2 ? uniform(0, 200) : -1;
  c.window_right = mask == 1 ? 0 : mask == 2 ? uniform(0, 50) : -1;
  c.sinks = uniform(0, 2) == 0;
  c.softcap = uniform(0, 3) == 0 ? 5.f : 0.f;
  c.seqused = uniform(0, 2) == 0;
  c.dlse = uniform(0, 1) == 0;
  const int n = uniform(1, 8);
  const bool decode = uniform(0, 5) == 0;
  const int boundaries[] = {63, 64, 65, 127, 128, 129};
  auto length = [&] {
    switch (uniform(0, 5)) {
      case 0: return 0;
      case 1: return uniform(1, 8);
      case 2: return boundaries[uniform(0, 5)];
      case 3: return uniform(60, 200);
      default: return uniform(0, 500);
    }
  };
  for (int b = 0; b < n; ++b) {
    const int k = length();
    const int q = decode ? std::min(k, 1) : (uniform(0, 2) == 0 ? length() : k);
    c.lq.push_back(q);
    c.lk.push_back(k);
    c.used_q.push_back(c.seqused ? uniform(0, q) : q);
    c.used_k.push_back(c.seqused ? uniform(0, k) : k);
  }
  c.pad_q = uniform(0, 1) ? uniform(0, 70) : 0;
  c.pad_k = uniform(0, 1) ? uniform(0, 70) : 0;
  return c;
}

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)) != cudaSuccess) std::abort();
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <typename T>
T* nan_buffer(size_t n) {  // all bits set: NaN in f32, bf16 and fp16
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) std::abort();
  cudaMemset(d, 0xFF, std::max<size_t>(n, 1) * sizeof(T));
  return d;
}

struct Tensors {  // host copies, [T, H, D] / [H, T], as float (the Element-rounded values the kernel reads)
  std::vector<float> q, k, v, o, dout, lse, dlse, sinks;
};

// The forward for one (sequence, head) in double: o and lse of the used query rows, as the kernel's forward gives
// them (the backward then reads them rounded, as it would from the forward).
void forward_rows(const Config& c, const Tensors& t, int q0, int k0, int sq, int sk, int h, double scale,
                  std::vector<double>& out, std::vector<double>& lse) {
  const int g = h / (c.hq / c.hk);
  out.assign(size_t(sq) * D, 0.0);
  lse.assign(sq, -INFINITY);
  std::vector<double> s(sk);
  for (int i = 0; i < sq; ++i) {
    double m = -INFINITY;
    for (int j = 0; j < sk; ++j) {
      const int diag = i + sk - sq;
      if ((c.window_right >= 0 && j > diag + c.window_right) || (c.window_left >= 0 && j < diag - c.window_left)) {
        s[j] = -INFINITY;
        continue;
      }
      double dot = 0;
      for (int e = 0; e < D; ++e) dot += double(t.q[(size_t(q0 + i) * c.hq + h) * D + e]) * t.k[(size_t(k0 + j) * c.hk + g) * D + e];
      dot *= scale;
      if (c.softcap > 0) dot = c.softcap * std::tanh(dot / c.softcap);
      s[j] = dot;
      m = std::max(m, dot);
    }
    const double sink = c.sinks ? t.sinks[h] : -INFINITY;
    const double mm = std::max(m, sink);
    if (std::isinf(mm)) continue;
    double sum = std::isinf(sink) ? 0.0 : std::exp(sink - mm);
    for (int j = 0; j < sk; ++j) sum += std::isinf(s[j]) ? 0.0 : std::exp(s[j] - mm);
    lse[i] = mm + std::log(sum);
    for (int j = 0; j < sk; ++j) {
      if (std::isinf(s[j])) continue;
      const double p = std::exp(s[j] - mm) / sum;
      for (int e = 0; e < D; ++e) out[size_t(i) * D + e] += p * t.v[(size_t(k0 + j) * c.hk + g) * D + e];
    }
  }
}

// The backward for one (sequence, query head) in double from the (rounded) o and lse: adds into dq [Tq, Hq, D],
// dk / dv (this head's share, [Tk, D]), dsink (this head's dsinks terms) and dsink_scale (their magnitudes).
void backward_rows(const Config& c, const Tensors& t, int q0, int k0, int sq, int sk, int h, double scale, int tq,
                   std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv, double& dsink,
                   double& dsink_scale) {
  const int g = h / (c.hq / c.hk);
  for (int i = 0; i < sq; ++i) {
    const size_t qi = (size_t(q0 + i) * c.hq + h) * D;
    const double lse = t.lse[size_t(h) * tq + q0 + i];
    if (std::isinf(lse)) continue;  // a row that sees nothing: no gradient
    double dpsum = c.dlse ? -double(t.dlse[size_t(h) * tq + q0 + i]) : 0.0;
    double magnitude = std::fabs(dpsum);
    for (int e = 0; e < D; ++e) {
      dpsum += double(t.dout[qi + e]) * t.o[qi + e];
      magnitude += std::fabs(double(t.dout[qi + e]) * t.o[qi + e]);
    }
    if (c.sinks) {
      dsink += -std::exp(t.sinks[h] - lse) * dpsum;
      dsink_scale += std::exp(t.sinks[h] - lse) * magnitude;
    }
    for (int j = 0; j < sk; ++j) {
      const int diag = i + sk - sq;
      if ((c.window_right >= 0 && j > diag + c.window_right) || (c.window_left >= 0 && j < diag - c.window_left)) {
        continue;
      }
      const size_t kj = (size_t(k0 + j) * c.hk + g) * D;
      double dot = 0, dp = 0;
      for (int e = 0; e < D; ++e) dot += double(t.q[qi + e]) * t.k[kj + e], dp += double(t.dout[qi + e]) * t.v[kj + e];
      double s = dot * scale, dtanh = 1;
      if (c.softcap > 0) {
        const double th = std::tanh(s / c.softcap);
        s = c.softcap * th;
        dtanh = 1 - th * th;
      }
      const double p = std::exp(s - lse);
      const double ds = p * (dp - dpsum) * dtanh;
      for (int e = 0; e < D; ++e) {
        dq[qi + e] += scale * ds * t.k[kj + e];
        dk[size_t(k0 + j) * D + e] += scale * ds * t.q[qi + e];
        dv[size_t(k0 + j) * D + e] += p * t.dout[qi + e];
      }
    }
  }
}

double rel_err(const std::vector<float>& got, const std::vector<double>& want, const std::vector<bool>* rows,
               size_t row_elems) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (rows != nullptr && !(*rows)[i / row_elems]) continue;
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

int run(const Config& c) {
  const int n = static_cast<int>(c.lq.size());
  std::vector<int> cu_q(n + 1, 0), cu_k(n + 1, 0);
  for (int b = 0; b < n; ++b) cu_q[b + 1] = cu_q[b] + c.lq[b], cu_k[b + 1] = cu_k[b] + c.lk[b];
  const int tq = cu_q[n] + c.pad_q, tk = cu_k[n] + c.pad_k;
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<bool> live_q(tq, false), live_k(tk, false);
  for (int b = 0; b < n; ++b) {
    for (int r = cu_q[b]; r < cu_q[b] + c.used_q[b]; ++r) live_q[r] = true;
    for (int r = cu_k[b]; r < cu_k[b] + c.used_k[b]; ++r) live_k[r] = true;
  }
  std::mt19937 rng(c.seed * 7919 + 1);
  std::normal_distribution<float> normal;
  Tensors t;
  // Element-rounded random values; rows no sequence uses hold NaN on the device (the host copy keeps the finite
  // value: the reference never reads those rows).
  auto make = [&](int rows, int heads, std::vector<float>& host, const std::vector<bool>& live) {
    std::vector<Element> dev(size_t(rows) * heads * D);
    host.resize(dev.size());
    for (size_t i = 0; i < dev.size(); ++i) {
      dev[i] = Element(normal(rng));
      host[i] = float(dev[i]);
      if (!live[i / (size_t(heads) * D)]) dev[i] = Element(NAN);
    }
    return to_device(dev);
  };
  Element* q = make(tq, c.hq, t.q, live_q);
  Element* k = make(tk, c.hk, t.k, live_k);
  Element* v = make(tk, c.hk, t.v, live_k);
  Element* dout = make(tq, c.hq, t.dout, live_q);
  t.sinks.resize(c.hq);
  for (auto& s : t.sinks) s = normal(rng);
  t.dlse.resize(size_t(c.hq) * tq);
  for (size_t i = 0; i < t.dlse.size(); ++i) t.dlse[i] = live_q[i % tq] ? normal(rng) : NAN;

  // The forward's o and lse (reference, rounded as the kernel's forward would store them); NaN in unused rows.
  std::vector<Element> o_dev(size_t(tq) * c.hq * D, Element(NAN));
  t.o.assign(o_dev.size(), 0.f);
  t.lse.assign(size_t(c.hq) * tq, NAN);
  {
    std::vector<std::thread> workers;
    for (int h = 0; h < c.hq; ++h) {
      workers.emplace_back([&, h] {
        std::vector<double> out, lse;
        for (int b = 0; b < n; ++b) {
          forward_rows(c, t, cu_q[b], cu_k[b], c.used_q[b], c.used_k[b], h, scale, out, lse);
          for (int i = 0; i < c.used_q[b]; ++i) {
            t.lse[size_t(h) * tq + cu_q[b] + i] = float(lse[i]);
            for (int e = 0; e < D; ++e) {
              const size_t at = (size_t(cu_q[b] + i) * c.hq + h) * D + e;
              o_dev[at] = Element(float(out[size_t(i) * D + e]));
              t.o[at] = float(o_dev[at]);
            }
          }
        }
      });
    }
    for (auto& w : workers) w.join();
  }
  Element* o = to_device(o_dev);
  float* lse = to_device(t.lse);
  float* dlse = to_device(t.dlse);
  float* sinks = to_device(t.sinks);
  int *dcu_q = to_device(cu_q), *dcu_k = to_device(cu_k);
  int *dused_q = to_device(c.used_q), *dused_k = to_device(c.used_k);
  const flashjax::BwdWorkspaceLayout layout = flashjax::bwd_varlen_workspace_layout(tq, n, c.hq, D);
  Element* dq = nan_buffer<Element>(size_t(tq) * c.hq * D);
  Element* dk = nan_buffer<Element>(size_t(tk) * c.hk * D);
  Element* dv = nan_buffer<Element>(size_t(tk) * c.hk * D);
  float* dsinks = nan_buffer<float>(c.hq);
  float* dq_accum = nan_buffer<float>(layout.dq_accum);
  float* dpsum = nan_buffer<float>(layout.per_row);
  float* lse_log2 = nan_buffer<float>(layout.per_row);

  flashjax::BwdParams p;
  p.dtype = std::is_same_v<Element, cutlass::half_t> ? flashjax::DType::kFloat16 : flashjax::DType::kBFloat16;
  p.batch = 1, p.seqlen_q = tq, p.seqlen_k = tk, p.heads_q = c.hq, p.heads_k = c.hk, p.head_dim = D;
  p.q_row_stride = p.o_row_stride = p.do_row_stride = p.dq_row_stride = int64_t(c.hq) * D;
  p.q_head_stride = p.o_head_stride = p.do_head_stride = p.dq_head_stride = D;
  p.q_batch_stride = p.o_batch_stride = p.do_batch_stride = p.dq_batch_stride = int64_t(tq) * c.hq * D;
  p.k_row_stride = p.v_row_stride = p.dk_row_stride = p.dv_row_stride = int64_t(c.hk) * D;
  p.k_head_stride = p.v_head_stride = p.dk_head_stride = p.dv_head_stride = D;
  p.k_batch_stride = p.v_batch_stride = p.dk_batch_stride = p.dv_batch_stride = int64_t(tk) * c.hk * D;
  p.lse_head_stride = tq, p.lse_batch_stride = 0;
  p.softmax_scale = float(scale);
  p.softcap = c.softcap;
  p.window_left = c.window_left, p.window_right = c.window_right;
  p.cu_seqlens_q = dcu_q, p.cu_seqlens_k = dcu_k, p.num_seqs = n;
  if (c.seqused) p.seqused_q = dused_q, p.seqused_k = dused_k;
  if (c.sinks) p.sinks = sinks, p.dsinks = dsinks;
  if (c.dlse) p.dlse = dlse;
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse, p.dout = dout;
  p.dq = dq, p.dk = dk, p.dv = dv;
  p.dq_accum = dq_accum, p.dpsum = dpsum, p.lse_log2 = lse_log2, p.seqlen_q_rounded = layout.seqlen_q_rounded;
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  std::printf("%s ... ", c.describe().c_str());
  std::fflush(stdout);
  cudaError_t err = flashjax::sm90::run_bwd<Element, D>(p, stream);
  if (err != cudaSuccess) {
    std::printf("LAUNCH ERROR %s\n", cudaGetErrorString(err));
    return 1;
  }
  const auto start = std::chrono::steady_clock::now();
  while (cudaStreamQuery(stream) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(10)) {
      std::printf("HANG\n");
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    std::printf("KERNEL ERROR %s\n", cudaGetErrorString(err));
    std::_Exit(4);
  }
  auto to_host = [](const Element* dev, size_t count) {
    std::vector<Element> h(count);
    cudaMemcpy(h.data(), dev, count * sizeof(Element), cudaMemcpyDeviceToHost);
    std::vector<float> f(count);
    for (size_t i = 0; i < count; ++i) f[i] = float(h[i]);
    return f;
  };
  const std::vector<float> got_dq = to_host(dq, size_t(tq) * c.hq * D), got_dk = to_host(dk, size_t(tk) * c.hk * D),
                           got_dv = to_host(dv, size_t(tk) * c.hk * D);
  std::vector<float> got_dsinks(c.hq);
  cudaMemcpy(got_dsinks.data(), dsinks, c.hq * sizeof(float), cudaMemcpyDeviceToHost);
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)dout, (void*)lse, (void*)dlse, (void*)sinks,
                    (void*)dcu_q, (void*)dcu_k, (void*)dused_q, (void*)dused_k, (void*)dq, (void*)dk, (void*)dv,
                    (void*)dsinks, (void*)dq_accum, (void*)dpsum, (void*)lse_log2}) {
    cudaFree(ptr);
  }
  cudaStreamDestroy(stream);

  // The reference gradients: per query head, dK / dV shares summed over the GQA group afterwards.
  std::vector<double> want_dq(got_dq.size(), 0.0), want_dk(got_dk.size(), 0.0), want_dv(got_dv.size(), 0.0);
  std::vector<double> want_dsinks(c.hq, 0.0), dsinks_scale(c.hq, 0.0);
  {
    std::vector<std::vector<double>> dk_h(c.hq, std::vector<double>(size_t(tk) * D, 0.0)), dv_h = dk_h;
    std::vector<std::thread> workers;
    for (int h = 0; h < c.hq; ++h) {
      workers.emplace_back([&, h] {
        for (int b = 0; b < n; ++b) {
          backward_rows(c, t, cu_q[b], cu_k[b], c.used_q[b], c.used_k[b], h, scale, tq, want_dq, dk_h[h], dv_h[h],
                        want_dsinks[h], dsinks_scale[h]);
        }
      });
    }
    for (auto& w : workers) w.join();
    for (int h = 0; h < c.hq; ++h) {
      const int g = h / (c.hq / c.hk);
      for (int r = 0; r < tk; ++r) {
        for (int e = 0; e < D; ++e) {
          want_dk[(size_t(r) * c.hk + g) * D + e] += dk_h[h][size_t(r) * D + e];
          want_dv[(size_t(r) * c.hk + g) * D + e] += dv_h[h][size_t(r) * D + e];
        }
      }
    }
  }
  const double e_dq = rel_err(got_dq, want_dq, nullptr, 1), e_dk = rel_err(got_dk, want_dk, nullptr, 1),
               e_dv = rel_err(got_dv, want_dv, nullptr, 1);
  double e_ds = 0;
  for (int h = 0; h < c.hq && c.sinks; ++h) {
    // Against the sum of its terms' magnitudes, as test_varlen.py measures dsinks.
    const double err = std::fabs(got_dsinks[h] - want_dsinks[h]) / std::max(dsinks_scale[h], 1e-6);
    e_ds = std::max(e_ds, std::isfinite(got_dsinks[h]) ? err : INFINITY);
  }
  // Rows no sequence uses: exactly zero.
  int unused_nonzero = 0;
  for (size_t i = 0; i < got_dq.size(); ++i) unused_nonzero += !live_q[i / (size_t(c.hq) * D)] && got_dq[i] != 0.f;
  for (size_t i = 0; i < got_dk.size(); ++i) {
    unused_nonzero += !live_k[i / (size_t(c.hk) * D)] && (got_dk[i] != 0.f || got_dv[i] != 0.f);
  }
  const bool ok = e_dq <= kTol && e_dk <= kTol && e_dv <= kTol && e_ds <= kTol && unused_nonzero == 0;
  std::printf("%s dq %.3g dk %.3g dv %.3g dsinks %.3g unused-nonzero %d", ok ? "ok" : "BAD", e_dq, e_dk, e_dv, e_ds,
              unused_nonzero);
  if (!ok && std::getenv("SWEEP_DETAIL") != nullptr) {  // per sequence: which one is wrong
    for (int b = 0; b < n; ++b) {
      std::vector<bool> rows_q(tq, false), rows_k(tk, false);
      for (int r = cu_q[b]; r < cu_q[b] + c.used_q[b]; ++r) rows_q[r] = true;
      for (int r = cu_k[b]; r < cu_k[b] + c.used_k[b]; ++r) rows_k[r] = true;
      std::printf("\n   seq %d q %d/%d k %d/%d: dq %.3g dk %.3g dv %.3g", b, c.used_q[b], c.lq[b], c.used_k[b],
                  c.lk[b], rel_err(got_dq, want_dq, &rows_q, size_t(c.hq) * D),
                  rel_err(got_dk, want_dk, &rows_k, size_t(c.hk) * D),
                  rel_err(got_dv, want_dv, &rows_k, size_t(c.hk) * D));
    }
  }
  std::printf("\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const int configs = argc > 1 ? std::atoi(argv[1]) : 100;
  const int first = argc > 2 ? std::atoi(argv[2]) : 0;
  int failed = 0;
  for (int seed = first; seed < first + configs; ++seed) failed += run(random_config(seed));
  std::printf("D %d%s: %d of %d configs failed\n", D, std::is_same_v<Element, cutlass::half_t> ? " fp16" : "", failed,
              configs);
  return failed == 0 ? 0 : 1;
}

// Issue 37 lab: the sm90 varlen forward outside JAX, against a CPU reference, on random packings (or one given
// config), with a watchdog: a launch that does not finish in 10 s prints HANG with its config and exits 3 (the
// context cannot recover). Per config: N sequences of random lengths (many empty and tiny), q and k packed
// differently, padding tokens, seqused, GQA, causal / window, sinks, softcap, D 64/128/256 bf16 and D 128 fp16.
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -lineinfo -Icsrc -Icsrc/include \
//     -isystem <cutlass>/include lab/experiments/sm90_varlen_sweep.cu -o /tmp/varlen_sweep
//   /tmp/varlen_sweep [configs [first_seed]]      random configs (default 200 from seed 0)
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

#include "kernels/sm90/fwd_launch.cuh"

namespace {

struct Config {
  int seed, d, hq, hk;
  bool fp16, causal, sinks, seqused;
  int window_left, window_right;
  float softcap;
  std::vector<int> lq, lk, used_q, used_k;
  int pad_q, pad_k;
  std::string describe() const {
    std::string s = "seed " + std::to_string(seed) + " d " + std::to_string(d) + (fp16 ? " fp16" : " bf16") +
                    " h " + std::to_string(hq) + "/" + std::to_string(hk) + " win (" + std::to_string(window_left) +
                    "," + std::to_string(window_right) + ")" + (sinks ? " sinks" : "") +
                    (softcap > 0 ? " softcap" : "") + (seqused ? " seqused" : "") + " pad " +
                    std::to_string(pad_q) + "/" + std::to_string(pad_k) + " lq/lk/used:";
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
  const int dims[] = {64, 128, 256, 128};
  const int pick = uniform(0, 3);
  c.d = dims[pick];
  c.fp16 = pick == 3;
  const int groups[] = {1, 1, 2, 4};
  c.hk = uniform(1, 2);
  c.hq = c.hk * groups[uniform(0, 3)];
  const int mask = uniform(0, 3);
  c.causal = mask == 1;
  c.window_left = mask == 2 ? uniform(0, 200) : -1;
  c.window_right = mask == 1 ? 0 : mask == 2 ? uniform(0, 50) : -1;
  c.sinks = uniform(0, 3) == 0;
  c.softcap = uniform(0, 3) == 0 ? 5.f : 0.f;
  c.seqused = uniform(0, 3) == 0;
  const int n = uniform(1, 8);
  const bool decode = uniform(0, 5) == 0;
  auto length = [&] {
    switch (uniform(0, 4)) {
      case 0: return 0;
      case 1: return uniform(1, 8);
      case 2: return uniform(60, 200);
      default: return uniform(0, 600);
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

// The reference for one (sequence, head): out rows (D floats each) and lse per used query row.
void reference_rows(const Config& c, const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, const std::vector<float>& sinks, int q0, int k0, int sq, int sk, int h,
                    float scale, std::vector<double>& out, std::vector<double>& lse) {
  const int g = h / (c.hq / c.hk), d = c.d;
  out.assign(size_t(sq) * d, 0.0);
  lse.assign(sq, -INFINITY);
  std::vector<double> s(sk);
  for (int i = 0; i < sq; ++i) {
    double m = -INFINITY;
    for (int j = 0; j < sk; ++j) {
      const int diag = i + sk - sq;
      const bool visible = (c.window_right < 0 || j <= diag + c.window_right) &&
                           (c.window_left < 0 || j >= diag - c.window_left);
      if (!visible) {
        s[j] = -INFINITY;
        continue;
      }
      double dot = 0;
      for (int e = 0; e < d; ++e) dot += q[(size_t(q0 + i) * c.hq + h) * d + e] * k[(size_t(k0 + j) * c.hk + g) * d + e];
      dot *= scale;
      if (c.softcap > 0) dot = c.softcap * std::tanh(dot / c.softcap);
      s[j] = dot;
      m = std::max(m, dot);
    }
    const double sink = c.sinks ? sinks[h] : -INFINITY;
    const double mm = std::max(m, sink);
    if (std::isinf(mm)) continue;  // no key, no sink: out 0, lse -inf
    double sum = std::isinf(sink) ? 0.0 : std::exp(sink - mm);
    for (int j = 0; j < sk; ++j) sum += std::isinf(s[j]) ? 0.0 : std::exp(s[j] - mm);
    lse[i] = mm + std::log(sum);
    for (int j = 0; j < sk; ++j) {
      if (std::isinf(s[j])) continue;
      const double p = std::exp(s[j] - mm) / sum;
      for (int e = 0; e < d; ++e) out[size_t(i) * d + e] += p * v[(size_t(k0 + j) * c.hk + g) * d + e];
    }
  }
}

template <typename Element, int D>
int run(const Config& c) {
  const int n = static_cast<int>(c.lq.size());
  std::vector<int> cu_q(n + 1, 0), cu_k(n + 1, 0);
  for (int b = 0; b < n; ++b) cu_q[b + 1] = cu_q[b] + c.lq[b], cu_k[b + 1] = cu_k[b] + c.lk[b];
  const int tq = cu_q[n] + c.pad_q, tk = cu_k[n] + c.pad_k;
  std::mt19937 rng(c.seed * 7919 + 1);
  std::normal_distribution<float> normal;
  // Inputs rounded to Element once; the reference reads the rounded values. Padding and unused rows hold NaN in
  // K/V (nothing may read them into a sequence's output) and random values in Q.
  auto make = [&](size_t rows, int heads, std::vector<Element>& dev, std::vector<float>& host, bool nan_unused,
                  const std::vector<int>& cu, const std::vector<int>& used) {
    dev.resize(rows * heads * D);
    host.resize(dev.size());
    for (size_t i = 0; i < dev.size(); ++i) {
      dev[i] = Element(normal(rng));
      host[i] = float(dev[i]);
    }
    if (!nan_unused || std::getenv("SWEEP_FINITE") != nullptr) return;
    std::vector<bool> live(rows, false);
    for (int b = 0; b < n; ++b) {
      for (int r = cu[b]; r < cu[b] + used[b]; ++r) live[r] = true;
    }
    for (size_t r = 0; r < rows; ++r) {
      if (live[r]) continue;
      for (size_t i = r * heads * D; i < (r + 1) * heads * D; ++i) dev[i] = Element(NAN);
    }
  };
  std::vector<Element> hq_, hk_, hv_;
  std::vector<float> fq, fk, fv;
  make(tq, c.hq, hq_, fq, false, cu_q, c.used_q);
  make(tk, c.hk, hk_, fk, true, cu_k, c.used_k);
  make(tk, c.hk, hv_, fv, true, cu_k, c.used_k);
  std::vector<float> sinks(c.hq);
  for (auto& s : sinks) s = normal(rng);
  std::vector<Element> o_init(size_t(tq) * c.hq * D, Element(NAN));  // every row must be written
  std::vector<float> lse_init(size_t(c.hq) * tq, NAN);

  Element *q = to_device(hq_), *k = to_device(hk_), *v = to_device(hv_), *o = to_device(o_init);
  float* lse = to_device(lse_init);
  float* dsinks = to_device(sinks);
  int *dcu_q = to_device(cu_q), *dcu_k = to_device(cu_k);
  int *dused_q = to_device(c.used_q), *dused_k = to_device(c.used_k);

  flashjax::FwdParams p;
  p.dtype = std::is_same_v<Element, cutlass::half_t> ? flashjax::DType::kFloat16 : flashjax::DType::kBFloat16;
  p.batch = 1, p.seqlen_q = tq, p.seqlen_k = tk, p.heads_q = c.hq, p.heads_k = c.hk, p.head_dim = D;
  p.q_row_stride = p.o_row_stride = int64_t(c.hq) * D, p.q_head_stride = p.o_head_stride = D;
  p.k_row_stride = p.v_row_stride = int64_t(c.hk) * D, p.k_head_stride = p.v_head_stride = D;
  p.q_batch_stride = p.o_batch_stride = int64_t(tq) * c.hq * D;
  p.k_batch_stride = p.v_batch_stride = int64_t(tk) * c.hk * D;
  p.lse_head_stride = tq, p.lse_batch_stride = int64_t(c.hq) * tq;
  p.softmax_scale = 1.f / std::sqrt(float(D));
  p.softcap = c.softcap;
  p.window_left = c.window_left, p.window_right = c.window_right;
  p.cu_seqlens_q = dcu_q, p.cu_seqlens_k = dcu_k, p.num_seqs = n;
  if (c.seqused) p.seqused_q = dused_q, p.seqused_k = dused_k;
  if (c.sinks) p.sinks = dsinks;
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  // GQA packed as the plan decides (the mean query length); FLASHJAX_SM90_PACK_GQA=1 packs every GQA config.
  flashjax::ChoiceQuery query;
  query.varlen = true;
  p.pack_group = flashjax::sm90::fwd_choices_for(D, p, query).pack_group;
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  std::printf("%s ... ", c.describe().c_str());
  std::fflush(stdout);
  cudaError_t err = flashjax::sm90::run_fwd<Element, D>(p, stream);
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
  std::vector<Element> ho(o_init.size());
  std::vector<float> hlse(lse_init.size());
  cudaMemcpy(ho.data(), o, ho.size() * sizeof(Element), cudaMemcpyDeviceToHost);
  cudaMemcpy(hlse.data(), lse, hlse.size() * sizeof(float), cudaMemcpyDeviceToHost);
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse, (void*)dsinks, (void*)dcu_q, (void*)dcu_k,
                    (void*)dused_q, (void*)dused_k}) {
    cudaFree(ptr);
  }
  cudaStreamDestroy(stream);

  // Every row: a used row of a sequence gets the reference, every other row out 0 and lse -inf.
  std::vector<double> want_o(size_t(tq) * c.hq * D, 0.0), want_lse(size_t(c.hq) * tq, -INFINITY);
  std::vector<std::thread> workers;
  for (int h = 0; h < c.hq; ++h) {
    workers.emplace_back([&, h] {
      std::vector<double> out, l;
      for (int b = 0; b < n; ++b) {
        reference_rows(c, fq, fk, fv, sinks, cu_q[b], cu_k[b], c.used_q[b], c.used_k[b], h, p.softmax_scale, out,
                       l);
        for (int i = 0; i < c.used_q[b]; ++i) {
          want_lse[size_t(h) * tq + cu_q[b] + i] = l[i];
          for (int e = 0; e < D; ++e) want_o[(size_t(cu_q[b] + i) * c.hq + h) * D + e] = out[size_t(i) * D + e];
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  double worst = 0, worst_lse = 0;
  int bad_row = -1, bad_head = -1;
  for (int t = 0; t < tq; ++t) {
    for (int h = 0; h < c.hq; ++h) {
      double row_err = 0;
      for (int e = 0; e < D; ++e) {
        const double got = float(ho[(size_t(t) * c.hq + h) * D + e]);
        const double want = want_o[(size_t(t) * c.hq + h) * D + e];
        row_err = std::max(row_err, std::isfinite(got) ? std::fabs(got - want) : 1e9);
      }
      const double gl = hlse[size_t(h) * tq + t], wl = want_lse[size_t(h) * tq + t];
      const double lerr = (std::isinf(wl) && gl == wl) ? 0.0 : std::isfinite(gl) ? std::fabs(gl - wl) : 1e9;
      if ((row_err > worst || lerr > worst_lse) && (row_err > 0.04 || lerr > 0.01) && bad_row < 0) {
        bad_row = t, bad_head = h;
      }
      worst = std::max(worst, row_err), worst_lse = std::max(worst_lse, lerr);
    }
  }
  const bool ok = worst <= 0.04 && worst_lse <= 0.01;
  std::printf("%s out %.3g lse %.3g", ok ? "ok" : "BAD", worst, worst_lse);
  if (!ok && std::getenv("SWEEP_DETAIL") != nullptr) {
    for (int b = 0; b < n; ++b) {
      std::printf("\n   seq %d q %d k %d:", b, c.used_q[b], c.used_k[b]);
      int shown = 0;
      for (int i = 0; i < c.used_q[b] && shown < 12; ++i) {
        for (int h = 0; h < c.hq; ++h) {
          double e = 0;
          const size_t t = cu_q[b] + i;
          for (int x = 0; x < D; ++x) {
            const double got = float(ho[(t * c.hq + h) * D + x]);
            e = std::max(e, std::isfinite(got) ? std::fabs(got - want_o[(t * c.hq + h) * D + x]) : 1e9);
          }
          if (e > 0.04) {
            std::printf(" r%d/h%d:%.2g", i, h, e);
            ++shown;
          }
        }
      }
    }
  }
  if (!ok) {
    int b = n - 1;
    while (b > 0 && cu_q[b] > bad_row) --b;
    std::printf(" first bad row %d head %d (seq %d local row %d)", bad_row, bad_head, b, bad_row - cu_q[b]);
  }
  std::printf("\n");
  return ok ? 0 : 1;
}

// A config from the environment instead (no mask, no sinks, no softcap, no seqused, no padding):
// SWEEP_LQ=61,168 [SWEEP_LK=...] [SWEEP_D=128] [SWEEP_FP16=1] [SWEEP_H=4/1].
bool env_config(Config& c) {
  const char* lq = std::getenv("SWEEP_LQ");
  if (lq == nullptr) return false;
  auto parse = [](const char* text) {
    std::vector<int> out;
    for (const char* p = text; *p != 0;) {
      out.push_back(std::atoi(p));
      while (*p != 0 && *p != ',') ++p;
      if (*p == ',') ++p;
    }
    return out;
  };
  c = Config{};
  c.lq = parse(lq);
  c.lk = std::getenv("SWEEP_LK") ? parse(std::getenv("SWEEP_LK")) : c.lq;
  c.used_q = c.lq, c.used_k = c.lk;
  c.d = std::getenv("SWEEP_D") ? std::atoi(std::getenv("SWEEP_D")) : 128;
  c.fp16 = std::getenv("SWEEP_FP16") != nullptr;
  c.hq = 4, c.hk = 1;
  if (const char* h = std::getenv("SWEEP_H")) std::sscanf(h, "%d/%d", &c.hq, &c.hk);
  c.window_left = c.window_right = -1;
  return true;
}

int dispatch(const Config& c) {
#if defined(SWEEP_D128_ONLY)  // a quicker build for kernel experiments: the other widths are skipped
  if (c.fp16 || c.d != 128) return -1;  // skipped, counted apart
  return run<cutlass::bfloat16_t, 128>(c);
#endif
  if (c.fp16) return run<cutlass::half_t, 128>(c);
  switch (c.d) {
    case 64: return run<cutlass::bfloat16_t, 64>(c);
    case 128: return run<cutlass::bfloat16_t, 128>(c);
    default: return run<cutlass::bfloat16_t, 256>(c);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // One config by seed with details: SWEEP_DETAIL=1 varlen_sweep 1 <seed>.
  const int configs = argc > 1 ? std::atoi(argv[1]) : 200;
  const int first = argc > 2 ? std::atoi(argv[2]) : 0;
  int failed = 0;
  if (Config c; env_config(c)) {
    const int result = dispatch(c);
    if (result < 0) std::printf("skipped: this build has D 128 bf16 only\n");
    return result > 0 ? 1 : 0;
  }
  int skipped = 0;
  for (int seed = first; seed < first + configs; ++seed) {
    const int result = dispatch(random_config(seed));
    if (result < 0) {
      ++skipped;
    } else {
      failed += result;
    }
  }
  std::printf("%d of %d configs failed (%d skipped)\n", failed, configs - skipped, skipped);
  return failed == 0 ? 0 : 1;
}

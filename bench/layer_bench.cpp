// The gemm/ and layer/ families of mha_bench (layer_bench.h).
#include "layer_bench.h"

#include <benchmark/benchmark.h>
#include <mha/layer.h>
#include <mha/registry.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "composed.h"
#include "layer.h"

namespace mha::bench {
namespace {

using Tensor = std::vector<float, SharedAllocator<float>>;

// Uniform in [-scale, scale) (xorshift: cheap, and touches every page).
void fill(Tensor& x, std::uint64_t seed, float scale) {
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& f : x) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    f = scale *
        static_cast<float>(static_cast<double>(s >> 40) / static_cast<double>(1ull << 23) - 1.0);
  }
}

Tensor tensor(std::int64_t n, std::uint64_t seed, float scale) {
  Tensor t(static_cast<std::size_t>(n));
  fill(t, seed, scale);
  return t;
}

// A peer timed as run_peer_benchmark does for attention: batches of about 20 ms, the seconds
// measured by the server; `once` is prepare's figure (negative: failed, with `why`).
double time_peer(benchmark::State& state, PeerServer& server, double once, const std::string& why) {
  if (once < 0) {
    state.SkipWithError(why.c_str());
    return -1;
  }
  const long long batch = std::max(1LL, static_cast<long long>(0.02 / std::max(once, 1e-9)));
  double seconds = 0.0;
  std::string error;
  while (state.KeepRunningBatch(batch)) {
    const double t = server.run(batch, &error);
    if (t < 0) {
      state.SkipWithError(error.c_str());
      break;
    }
    state.SetIterationTime(t);
    seconds += t;
  }
  server.release();
  return state.error_occurred() ? -1 : seconds;
}

// Whether a call that must read `bytes` (weights, a KV cache) is to read them from memory:
// then every timed call starts with them out of every cache (timed_loop).
bool reads_dram(const Probe& probe, double bytes) {
  return bytes > 0 && probe.level_of(static_cast<std::int64_t>(bytes)) == Level::dram;
}

// What a cold call reads before it (timed_loop): 3x the reported last-level cache, at least
// 256 MiB.
std::int64_t flush_bytes(const Probe& probe) {
  return std::max<std::int64_t>(3 * probe.caches.last_level(), std::int64_t{256} << 20);
}

// The timed loop; returns the seconds of the calls alone. Cold: before each call, untimed,
// a buffer of 3x the reported last-level cache (at least 256 MiB) is read, so that no call
// finds its data in any cache whatever the true cache sizes (a VM may report 300 MiB of L3
// that reads at DRAM speed while the host's L3 keeps part of a 64 MiB weight read again and
// again: the same weight read every call streamed at 1.03-1.4x the DRAM figure). The
// attention decode rotates over copies of its cache instead; here a copy would be a layer.
// The peers do the same in their server (prepare's cold=).
double timed_loop(benchmark::State& state, const Probe& probe, bool cold,
                  const std::function<void()>& call) {
  using clock = std::chrono::steady_clock;
  if (!cold) {
    const auto start = clock::now();
    for (auto _ : state) {
      call();
      benchmark::ClobberMemory();
    }
    return std::chrono::duration<double>(clock::now() - start).count();
  }
  static std::vector<float> flush;
  if (flush.empty())
    flush.assign(static_cast<std::size_t>(flush_bytes(probe)) / sizeof(float), 1.0f);
  double seconds = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    float sum = 0.0f;
    for (std::size_t i = 0; i < flush.size(); i += 16) sum += flush[i];  // a float per line
    benchmark::DoNotOptimize(sum);
    state.ResumeTiming();
    const auto start = clock::now();
    call();
    benchmark::ClobberMemory();
    seconds += std::chrono::duration<double>(clock::now() - start).count();
  }
  return seconds;
}

// The FMA peak fraction, and for a working set read from memory the fraction of the probe's
// DRAM bandwidth. As for attention (main.cpp's set_counters), a figure above the probe's is
// measured again right after the timed loop (counter peak_gflops_now, dram_gbps_now) and the
// fraction is over the higher: another process may have held a core while the probe ran. A
// fraction still above 1 is turned into an error by main's reporter.
void set_rate_counters(benchmark::State& state, const Probe& probe, const std::string& isa,
                       int threads, double flops, double bytes, double seconds) {
  const double per_second = static_cast<double>(state.iterations()) / seconds;
  const int all = threads > 1 ? 1 : 0;
  const int cores = all ? probe.cores : 1;
  const auto limit_of = [&](double value, double figure, const char* now, auto measure) {
    if (value <= figure) return figure;
    figure = std::max(figure, measure());
    state.counters[now] = figure;
    return figure;
  };
  const double gflops = flops / 1e9 * per_second;
  state.counters["GFLOPS"] = gflops;
  const FmaPeak& fma = probe.fma_peak(isa);
  state.counters["peak_frac"] = gflops / limit_of(gflops, fma.gflops[all], "peak_gflops_now", [&] {
                                  return measure_fma_gflops(fma.isa, cores);
                                });
  if (reads_dram(probe, bytes) && probe.dram_gbps[all] > 0) {
    const double gbps = bytes / 1e9 * per_second;
    state.counters["GBps"] = gbps;
    state.counters["bw_frac"] = gbps / limit_of(gbps, probe.dram_gbps[all], "dram_gbps_now", [&] {
                                  return measure_dram_gbps(probe.caches, cores);
                                });
    state.SetLabel("bw:dram");
  }
}

// ---------------------------------------------------------------------------------------
// GEMM: C [m][n] = A [m][k] B [k][n], B a weight packed once (not timed), A packed per call.

struct GemmCase {
  std::int64_t m, n, k;
  int threads;
  std::string name(const std::string& impl) const {
    std::ostringstream os;
    os << "gemm/" << impl << "/M:" << m << "/N:" << n << "/K:" << k << "/threads:" << threads;
    return os.str();
  }
};

std::vector<GemmCase> gemm_cases(const LayerBenchOptions& o) {
  std::vector<GemmCase> out;
  const auto add = [&](std::int64_t m, std::int64_t n, std::int64_t k) {
    out.push_back({m, n, k, 1});
    if (o.cores > 1) out.push_back({m, n, k, o.cores});
  };
  if (o.quick) {
    add(64, 256, 256);
    add(1, 256, 256);
    return out;
  }
  // Projection shapes: n tokens of width d times a d x d weight (W^Q, W^O), and the fused
  // decode step's one token; the bars are at n = 2048, d = 4096 and 1024.
  const std::vector<std::int64_t> widths = o.full ? std::vector<std::int64_t>{512, 1024, 2048, 4096}
                                                  : std::vector<std::int64_t>{1024, 4096};
  const std::vector<std::int64_t> tokens = o.full
                                               ? std::vector<std::int64_t>{1, 16, 256, 2048, 4096}
                                               : std::vector<std::int64_t>{1, 2048};
  for (std::int64_t d : widths) {
    for (std::int64_t n : tokens) add(n, d, d);
  }
  return out;
}

struct GemmData {
  std::string key;
  GemmCase c{};
  Tensor a, b, out;
};

GemmData& gemm_data(const GemmCase& c) {
  static GemmData data;
  const std::string key = c.name("");
  if (data.key == key) return data;
  data = GemmData();
  data.key = key;
  data.c = c;
  data.a = tensor(c.m * c.k, 1, 1.0f);
  data.b = tensor(c.k * c.n, 2, 1.0f / std::sqrt(static_cast<float>(c.k)));
  data.out.assign(static_cast<std::size_t>(c.m * c.n), 0.0f);
  return data;
}

// 64 sampled elements within gamma(k + 1) sum |a b| of the exact product: the bound of any
// order of summation (mha/gemm.h), so it holds for the libraries too.
std::string check_gemm_output(const GemmData& d) {
  const GemmCase& c = d.c;
  const double u = std::ldexp(1.0, -24), nu = static_cast<double>(c.k + 1) * u;
  const double gamma = nu / (1.0 - nu);
  std::uint64_t s = 12345;
  for (int sample = 0; sample < 64; ++sample) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const auto i = static_cast<std::int64_t>((s >> 33) % static_cast<std::uint64_t>(c.m));
    const auto j = static_cast<std::int64_t>((s >> 17) % static_cast<std::uint64_t>(c.n));
    double exact = 0.0, magnitude = 0.0;
    for (std::int64_t l = 0; l < c.k; ++l) {
      const double t = static_cast<double>(d.a[static_cast<std::size_t>(i * c.k + l)]) *
                       d.b[static_cast<std::size_t>(l * c.n + j)];
      exact += t;
      magnitude += std::fabs(t);
    }
    const double got = d.out[static_cast<std::size_t>(i * c.n + j)];
    if (!(std::fabs(got - exact) <= gamma * magnitude)) {
      std::ostringstream os;
      os << "c[" << i << "][" << j << "] = " << got << ", exact " << exact << " (bound "
         << gamma * magnitude << ")";
      return os.str();
    }
  }
  return {};
}

double gemm_flops(const GemmCase& c) {
  return 2.0 * static_cast<double>(c.m) * static_cast<double>(c.n) * static_cast<double>(c.k);
}
double gemm_weight_bytes(const GemmCase& c) {
  return 4.0 * static_cast<double>(c.n) * static_cast<double>(c.k);
}

// One GEMM implementation: set up for the data (packing, not timed), then run.
struct GemmImpl {
  std::string name, isa;
  std::function<std::function<void(int)>(GemmData&)> setup;
  bool small_only = false;  // the portable kernel: shapes of at most 2^28 multiply-adds
};

std::vector<GemmImpl> gemm_impls() {
  std::vector<GemmImpl> out;
  for (const GemmInfo& g : all_gemms()) {
    if (!available(g)) continue;
    out.push_back({g.name, isa_name(g.isa),
                   [info = &g](GemmData& d) {
                     auto b =
                         std::make_shared<PackedMatrix>(*info, d.c.k, d.c.n, d.b.data(), d.c.n, 1);
                     return std::function<void(int)>([b, &d](int threads) {
                       gemm(d.c.m, d.a.data(), d.c.k, *b, nullptr, d.out.data(), d.c.n, threads);
                     });
                   },
                   g.isa == Isa::scalar});
  }
  // The libraries' sgemm, their threads set to the benchmark's (composed.h).
  const auto library = [&out](const char* name, Sgemm sgemm, void (*set_threads)(int)) {
    out.push_back({name, "", [sgemm, set_threads](GemmData& d) {
                     return std::function<void(int)>([&d, sgemm, set_threads](int threads) {
                       set_threads(threads);
                       sgemm(false, d.c.m, d.c.n, d.c.k, 1.0f, d.a.data(), d.c.k, d.b.data(), d.c.n,
                             d.out.data(), d.c.n);
                     });
                   }});
  };
#if MHA_HAVE_OPENBLAS
  library("openblas", &openblas_sgemm, &openblas_threads);
#endif
#if MHA_HAVE_ONEDNN
  library("onednn", &onednn_sgemm, &onednn_threads);
#endif
  (void)library;  // unused when neither library was found
  return out;
}

void run_gemm_benchmark(benchmark::State& state, const GemmImpl& impl, const GemmCase& c,
                        const Probe& probe) {
  GemmData& d = gemm_data(c);
  const std::function<void(int)> run = impl.setup(d);
  static std::set<std::string> verified;
  const std::string name = c.name(impl.name);
  if (verified.count(name) == 0) {
    std::fill(d.out.begin(), d.out.end(), std::nanf(""));
    run(c.threads);
    const std::string error = check_gemm_output(d);
    if (!error.empty()) {
      state.SkipWithError(("output differs from the reference: " + error).c_str());
      return;
    }
    verified.insert(name);
  }
  const double bytes = c.m <= 16 ? gemm_weight_bytes(c) : 0.0;
  const double seconds =
      timed_loop(state, probe, reads_dram(probe, bytes), [&] { run(c.threads); });
  set_rate_counters(state, probe, impl.isa, c.threads, gemm_flops(c), bytes, seconds);
}

void run_gemm_peer(benchmark::State& state, PeerServer& server, const std::string& peer,
                   const GemmCase& c, const Probe& probe) {
  GemmData& d = gemm_data(c);
  std::fill(d.out.begin(), d.out.end(), std::nanf(""));
  std::string why;
  const double bytes = c.m <= 16 ? gemm_weight_bytes(c) : 0.0;
  const bool cold = reads_dram(probe, bytes);
  const double once = server.prepare_gemm(peer, {c.m, c.n, c.k}, c.threads, d.a.data(), d.b.data(),
                                          d.out.data(), &why, cold ? flush_bytes(probe) : 0);
  if (once >= 0) {
    const std::string error = check_gemm_output(d);
    if (!error.empty()) {
      server.release();
      state.SkipWithError(("output differs from the reference: " + error).c_str());
      return;
    }
  }
  // Cold like the kernels when the weight is read from memory (the server's cold=).
  const double seconds = time_peer(state, server, once, peer + ": " + why);
  if (seconds > 0) set_rate_counters(state, probe, "", c.threads, gemm_flops(c), bytes, seconds);
}

// ---------------------------------------------------------------------------------------
// The layer: y = MultiHead(x) for n new tokens after `past` cached ones, weights dense
// [in][out], the past's K and V random (a decode step's cache).

struct LayerCase {
  LayerShape s;  // batch, d, heads, kv_heads, head_dim, n, past, causal (no biases)
  int threads;
  KvType kv = KvType::f32;  // the cache's element type ("/kv:<type>" unless f32)
  LayerConfig config() const { return {s.d, s.heads, s.kv_heads, s.head_dim}; }
  std::string name(const std::string& impl) const {
    std::ostringstream os;
    os << "layer/" << impl << "/B:" << s.batch << "/d:" << s.d << "/H:" << s.heads
       << "/Hkv:" << s.kv_heads << "/D:" << s.head_dim << "/n:" << s.n << "/Lk:" << s.past + s.n
       << "/causal:" << s.causal;
    if (kv != KvType::f32) os << "/kv:" << kv_type_name(kv);
    os << "/threads:" << threads;
    return os.str();
  }
};

std::vector<LayerCase> layer_cases(const LayerBenchOptions& o) {
  std::vector<LayerCase> out;
  const auto add = [&](std::int64_t d, std::int64_t h, std::int64_t hkv, std::int64_t n,
                       std::int64_t past, KvType kv = KvType::f32) {
    LayerShape s;
    s.batch = 1;
    s.d = d;
    s.heads = h;
    s.kv_heads = hkv;
    s.head_dim = d / h;
    s.n = n;
    s.past = past;
    s.causal = true;
    out.push_back({s, 1, kv});
    if (o.cores > 1) out.push_back({s, o.cores, kv});
  };
  // Decode steps with the cache in a reduced type (the project's layer only: the others
  // keep fp32 caches).
  constexpr KvType kReduced[] = {KvType::f16, KvType::bf16, KvType::i8};
  if (o.quick) {
    add(256, 4, 2, 64, 0);
    add(256, 4, 2, 1, 127);
    add(256, 4, 2, 1, 127, KvType::i8);
    return out;
  }
  // d = 4096, H = 32 (D = 128): prefill of a 2048-token prompt (GQA 32/8), and one decode
  // step at 8192 keys for MHA, GQA and MQA, whose caches are 256, 64 and 8 MiB.
  const std::vector<std::int64_t> kv_heads =
      o.full ? std::vector<std::int64_t>{32, 8, 1} : std::vector<std::int64_t>{8};
  for (std::int64_t hkv : kv_heads) {
    for (std::int64_t n :
         o.full ? std::vector<std::int64_t>{512, 2048} : std::vector<std::int64_t>{2048})
      add(4096, 32, hkv, n, 0);
  }
  for (std::int64_t hkv : {32, 8, 1}) {
    for (std::int64_t lk :
         o.full ? std::vector<std::int64_t>{2048, 8192, 32768} : std::vector<std::int64_t>{8192})
      add(4096, 32, hkv, 1, lk - 1);
  }
  // The same steps from a reduced cache: at the default size GQA 32/8 at 8192 keys.
  for (KvType kv : kReduced) {
    for (std::int64_t hkv :
         o.full ? std::vector<std::int64_t>{32, 8, 1} : std::vector<std::int64_t>{8}) {
      for (std::int64_t lk :
           o.full ? std::vector<std::int64_t>{2048, 8192, 32768} : std::vector<std::int64_t>{8192})
        add(4096, 32, hkv, 1, lk - 1, kv);
    }
  }
  return out;
}

struct LayerData {
  std::string key;
  LayerCase c{};
  Tensor x, wq, wk, wv, wo, y;
  Tensor past_k, past_v;  // [batch][Hkv][past][D]
  // The project's layer's cache after its last call (set up by layer_impls): for a reduced
  // type the reference reads the values it stores.
  std::shared_ptr<const KvCache> cache;
};

LayerData& layer_data(const LayerCase& c) {
  static LayerData data;
  const std::string key = c.name("");
  if (data.key == key) return data;
  data = LayerData();
  data.key = key;
  data.c = c;
  const LayerShape& s = c.s;
  const std::int64_t hd = s.heads * s.head_dim, kvd = s.kv_heads * s.head_dim;
  // Weights scaled by 1 / sqrt(fan-in), as initializers do, so activations stay O(1).
  const float in = 1.0f / std::sqrt(static_cast<float>(s.d));
  data.x = tensor(s.batch * s.n * s.d, 11, 1.0f);
  data.wq = tensor(s.d * hd, 12, in);
  data.wk = tensor(s.d * kvd, 13, in);
  data.wv = tensor(s.d * kvd, 14, in);
  data.wo = tensor(hd * s.d, 15, 1.0f / std::sqrt(static_cast<float>(hd)));
  data.y.assign(static_cast<std::size_t>(s.batch * s.n * s.d), 0.0f);
  if (s.past > 0) {
    data.past_k = tensor(s.batch * kvd * s.past, 16, 1.0f);
    data.past_v = tensor(s.batch * kvd * s.past, 17, 1.0f);
  }
  return data;
}

LayerWeights weights_of(const LayerData& d) {
  LayerWeights w;
  w.wq = d.wq.data();
  w.wk = d.wk.data();
  w.wv = d.wv.data();
  w.wo = d.wo.data();
  return w;
}

// A cache's stored keys and values as the reference takes them (reference/layer.h).
ref::StoredKv stored_of(const KvCache& cache) {
  return {cache.kv_type(), cache.k_view(),        cache.v_view(),
          cache.strides(), cache.scale_strides(), cache.length()};
}

// y against the double-precision layer and its derived bound (reference/layer.h): a decode
// step's rows (the past taken as exact), or for a causal prefill the first 16 positions of
// every sequence, which see only each other, and the last 16, which see the whole prompt.
std::string check_layer_output(const LayerData& d, double exp_ulp) {
  const LayerShape& s = d.c.s;
  const std::int64_t head = s.causal ? std::min<std::int64_t>(s.n, 16) : s.n;
  ref::PastKv past;
  if (s.past > 0) {
    past = {d.past_k.data(),
            d.past_v.data(),
            {s.kv_heads * s.past * s.head_dim, s.head_dim, s.past * s.head_dim},
            s.past};
  }
  // Rows [first, len) of sequences x[b][0 .. len).
  const auto check = [&](std::int64_t len, std::int64_t first) -> std::string {
    std::vector<float> x;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const float* row = d.x.data() + b * s.n * s.d;
      x.insert(x.end(), row, row + len * s.d);
    }
    // The reference (tens of seconds for the last rows of a 2048-token prompt at d = 4096)
    // once per shape, row range and exp_ulp, whatever the implementation and threads.
    static std::string cached_shape;
    static std::map<std::tuple<double, std::int64_t, std::int64_t>, ref::LayerResult> cache;
    std::ostringstream shape;
    shape << s.batch << ' ' << s.d << ' ' << s.heads << ' ' << s.kv_heads << ' ' << s.head_dim
          << ' ' << s.n << ' ' << s.past << ' ' << s.causal << ' ' << kv_type_name(d.c.kv);
    if (shape.str() != cached_shape) {
      cache.clear();
      cached_shape = shape.str();
    }
    auto found = cache.find({exp_ulp, len, first});
    if (found == cache.end()) {
      // A reduced cache: every key and value as the cache stores them (the past's and the
      // new token's), the queries projected from x.
      found = cache
                  .emplace(std::make_tuple(exp_ulp, len, first),
                           d.c.kv == KvType::f32
                               ? ref::layer(d.c.config(), weights_of(d), x.data(), s.batch, len,
                                            first, s.causal, exp_ulp, past)
                               : ref::layer(d.c.config(), weights_of(d), x.data(), s.batch, len,
                                            first, s.causal, exp_ulp, stored_of(*d.cache)))
                  .first;
    }
    const ref::LayerResult& r = found->second;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      for (std::int64_t i = first; i < len; ++i) {
        for (std::int64_t col = 0; col < s.d; ++col) {
          const double got = d.y[static_cast<std::size_t>((b * s.n + i) * s.d + col)];
          const double want = r.y[r.at(b, i - first, col)], tol = r.tol[r.at(b, i - first, col)];
          if (!(std::fabs(got - want) <= tol)) {
            std::ostringstream os;
            os << "y[" << b << "][" << i << "][" << col << "] = " << got << ", expected " << want
               << " (bound " << tol << ")";
            return os.str();
          }
        }
      }
    }
    return {};
  };
  std::string error = check(head, 0);
  if (error.empty() && head < s.n) error = check(s.n, std::max(head, s.n - 16));
  return error;
}

double layer_flops(const LayerShape& s) {
  const double n = static_cast<double>(s.batch * s.n), d = static_cast<double>(s.d);
  const double hd = static_cast<double>(s.heads * s.head_dim);
  const double kvd = static_cast<double>(s.kv_heads * s.head_dim);
  double pairs = 0.0;  // query-key pairs each query head computes
  for (std::int64_t i = 0; i < s.n; ++i) {
    pairs += static_cast<double>(s.causal ? s.past + i + 1 : s.past + s.n);
  }
  return 2.0 * n * d * (hd + 2.0 * kvd) + 2.0 * n * hd * d +
         4.0 * static_cast<double>(s.head_dim) * pairs * static_cast<double>(s.batch * s.heads);
}

// What one decode step must read: the four weights and the whole KV cache (in its type).
double layer_bytes(const LayerShape& s, KvType kv) {
  const double d = static_cast<double>(s.d), hd = static_cast<double>(s.heads * s.head_dim);
  const double kvd = static_cast<double>(s.kv_heads * s.head_dim);
  return 4.0 * (d * (hd + 2.0 * kvd) + hd * d) +
         static_cast<double>(KvCache::bytes(LayerConfig{s.d, s.heads, s.kv_heads, s.head_dim},
                                            s.batch, s.past + s.n, kv));
}

struct LayerImpl {
  std::string name, isa;
  double exp_ulp;
  bool kv_types;  // keeps its cache in any KvType (else fp32 only)
  // Set up for the data (packing, the past into the cache: not timed); the call it returns
  // computes one step from the same past every time.
  std::function<std::function<void(int)>(LayerData&)> setup;
};

// The layer composed from a library's sgemm and the composed attention (composed.h), as a
// user without fused kernels writes it: the cache token-major [B][capacity][Hkv][D], so that
// the K and V projections write it directly.
class ComposedLayer {
 public:
  ComposedLayer(Sgemm gemm, void (*set_threads)(int), LayerData& d)
      : gemm_(gemm), set_threads_(set_threads), attention_(gemm), d_(d) {
    const LayerShape& s = d.c.s;
    const std::int64_t kvd = s.kv_heads * s.head_dim, cap = s.past + s.n;
    q_.resize(static_cast<std::size_t>(s.batch * s.n * s.heads * s.head_dim));
    o_.resize(q_.size());
    k_.resize(static_cast<std::size_t>(s.batch * cap * kvd));
    v_.resize(k_.size());
    for (std::int64_t b = 0; b < s.batch; ++b) {  // the past, from head-major to token-major
      for (std::int64_t j = 0; j < s.kv_heads; ++j) {
        for (std::int64_t t = 0; t < s.past; ++t) {
          const std::int64_t from = ((b * s.kv_heads + j) * s.past + t) * s.head_dim;
          const std::int64_t to = (b * cap + t) * kvd + j * s.head_dim;
          std::copy_n(d.past_k.data() + from, s.head_dim, k_.data() + to);
          std::copy_n(d.past_v.data() + from, s.head_dim, v_.data() + to);
        }
      }
    }
  }

  void run(int threads) {
    set_threads_(threads);
    const LayerShape& s = d_.c.s;
    const std::int64_t hd = s.heads * s.head_dim, kvd = s.kv_heads * s.head_dim;
    const std::int64_t cap = s.past + s.n;
    gemm_(false, s.batch * s.n, hd, s.d, 1.0f, d_.x.data(), s.d, d_.wq.data(), hd, q_.data(), hd);
    for (std::int64_t b = 0; b < s.batch; ++b) {
      const float* x = d_.x.data() + b * s.n * s.d;
      const std::int64_t at = (b * cap + s.past) * kvd;
      gemm_(false, s.n, kvd, s.d, 1.0f, x, s.d, d_.wk.data(), kvd, k_.data() + at, kvd);
      gemm_(false, s.n, kvd, s.d, 1.0f, x, s.d, d_.wv.data(), kvd, v_.data() + at, kvd);
    }
    Problem p = make_problem(s.batch, s.n, cap, s.heads, s.kv_heads, s.head_dim, s.causal);
    p.k = p.v = {cap * kvd, kvd, s.head_dim};
    attention_.run(p, q_.data(), k_.data(), v_.data(), o_.data(), nullptr, threads);
    gemm_(false, s.batch * s.n, s.d, hd, 1.0f, o_.data(), hd, d_.wo.data(), s.d, d_.y.data(), s.d);
  }

 private:
  Sgemm gemm_;
  void (*set_threads_)(int);
  Composed attention_;
  LayerData& d_;
  std::vector<float> q_, o_, k_, v_;
};

std::vector<LayerImpl> layer_impls() {
  std::vector<LayerImpl> out;
  // The project's layer on its best GEMM kernel (its name is the benchmark's) and best
  // attention kernel.
  const GemmInfo& g = best_gemm();
  out.push_back({g.name, isa_name(g.isa), best_kernel().exp_ulp, true, [info = &g](LayerData& d) {
                   const LayerShape& s = d.c.s;
                   auto layer = std::make_shared<Layer>(d.c.config(), weights_of(d), info->name);
                   auto cache =
                       std::make_shared<KvCache>(d.c.config(), s.batch, s.past + s.n, d.c.kv);
                   if (s.past > 0) cache->append(d.past_k.data(), d.past_v.data(), s.past);
                   d.cache = cache;
                   return std::function<void(int)>([layer, cache, &d](int threads) {
                     const LayerShape& shape = d.c.s;
                     cache->truncate(shape.past);
                     layer->prefill(d.x.data(), shape.n, d.y.data(), *cache, shape.causal, threads);
                   });
                 }});
  const auto composed = [&out](const char* name, Sgemm gemm, void (*set_threads)(int)) {
    out.push_back({name, "", kComposedExpUlp, false, [gemm, set_threads](LayerData& d) {
                     auto layer = std::make_shared<ComposedLayer>(gemm, set_threads, d);
                     return std::function<void(int)>([layer](int threads) { layer->run(threads); });
                   }});
  };
#if MHA_HAVE_OPENBLAS
  composed("composed-openblas", &openblas_sgemm, &openblas_threads);
#endif
#if MHA_HAVE_ONEDNN
  composed("composed-onednn", &onednn_sgemm, &onednn_threads);
#endif
  (void)composed;
  return out;
}

void run_layer_benchmark(benchmark::State& state, const LayerImpl& impl, const LayerCase& c,
                         const Probe& probe) {
  LayerData& d = layer_data(c);
  const std::function<void(int)> run = impl.setup(d);
  static std::set<std::string> verified;
  const std::string name = c.name(impl.name);
  if (verified.count(name) == 0) {
    std::fill(d.y.begin(), d.y.end(), std::nanf(""));
    run(c.threads);
    const std::string error = check_layer_output(d, impl.exp_ulp);
    if (!error.empty()) {
      state.SkipWithError(("output differs from the reference: " + error).c_str());
      return;
    }
    verified.insert(name);
  }
  const double bytes = c.s.n == 1 ? layer_bytes(c.s, c.kv) : 0.0;
  const double seconds =
      timed_loop(state, probe, reads_dram(probe, bytes), [&] { run(c.threads); });
  set_rate_counters(state, probe, impl.isa, c.threads, layer_flops(c.s), bytes, seconds);
  state.counters["kv_cache_bytes"] =
      static_cast<double>(KvCache::bytes(c.config(), c.s.batch, c.s.past + c.s.n, c.kv));
}

void run_layer_peer(benchmark::State& state, PeerServer& server, const std::string& peer,
                    const LayerCase& c, const Probe& probe) {
  LayerData& d = layer_data(c);
  const LayerShape& s = c.s;
  // The peer's cache: head-major with capacity past + n, the past in front.
  Tensor k_cache, v_cache;
  if (s.past > 0) {
    const std::int64_t cap = s.past + s.n, rows = s.batch * s.kv_heads;
    k_cache.assign(static_cast<std::size_t>(rows * cap * s.head_dim), 0.0f);
    v_cache.assign(k_cache.size(), 0.0f);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy_n(d.past_k.data() + r * s.past * s.head_dim, s.past * s.head_dim,
                  k_cache.data() + r * cap * s.head_dim);
      std::copy_n(d.past_v.data() + r * s.past * s.head_dim, s.past * s.head_dim,
                  v_cache.data() + r * cap * s.head_dim);
    }
  }
  LayerTensors t;
  t.x = d.x.data();
  t.wq = d.wq.data();
  t.wk = d.wk.data();
  t.wv = d.wv.data();
  t.wo = d.wo.data();
  t.k_cache = s.past > 0 ? k_cache.data() : nullptr;
  t.v_cache = s.past > 0 ? v_cache.data() : nullptr;
  t.y = d.y.data();
  std::fill(d.y.begin(), d.y.end(), std::nanf(""));
  std::string why;
  const double bytes = s.n == 1 ? layer_bytes(s, KvType::f32) : 0.0;
  const bool cold = reads_dram(probe, bytes);
  const double once =
      server.prepare_layer(peer, s, c.threads, t, &why, cold ? flush_bytes(probe) : 0);
  if (once >= 0) {
    const std::string error = check_layer_output(d, kPeerExpUlp);
    if (!error.empty()) {
      server.release();
      state.SkipWithError(("output differs from the reference: " + error).c_str());
      return;
    }
  }
  const double seconds = time_peer(state, server, once, peer + ": " + why);
  if (seconds > 0) {  // cold like the layer when it reads from memory
    set_rate_counters(state, probe, "", c.threads, layer_flops(s), bytes, seconds);
    state.counters["kv_cache_bytes"] =
        static_cast<double>(KvCache::bytes(c.config(), s.batch, s.past + s.n));
  }
}

}  // namespace

namespace {

// Registers every case of a family: each implementation (run), then each peer that
// supports the case (run_peer), `rounds` times in turn, as main does for attention.
template <typename Case, typename Impl, typename Supports, typename Run, typename RunPeer,
          typename Skip>
void register_family(const LayerBenchOptions& o, const std::vector<Case>& cases,
                     const std::vector<Impl>& impls, Supports supports, Run run, RunPeer run_peer,
                     Skip skip) {
  for (const Case& c : cases) {
    std::vector<std::string> peers;
    if (o.server != nullptr) {
      for (const PeerInfo& peer : o.server->peers()) {
        std::string why;
        if (supports(*o.server, peer.name, c, &why)) peers.push_back(peer.name);
      }
    }
    const Probe* probe = o.probe;
    for (int r = 0; r < o.rounds; ++r) {
      for (const Impl& impl : impls) {
        if (skip(impl, c)) continue;
        benchmark::RegisterBenchmark(
            c.name(impl.name).c_str(),
            [&impl, c, probe, run](benchmark::State& st) { run(st, impl, c, *probe); })
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
      for (const std::string& peer : peers) {
        PeerServer* server = o.server;
        benchmark::RegisterBenchmark(c.name(peer).c_str(),
                                     [server, peer, c, probe, run_peer](benchmark::State& st) {
                                       run_peer(st, *server, peer, c, *probe);
                                     })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace

void register_gemm_benchmarks(const LayerBenchOptions& o) {
  static const std::vector<GemmImpl> impls = gemm_impls();
  register_family(
      o, gemm_cases(o), impls,
      [](PeerServer& server, const std::string& peer, const GemmCase& c, std::string* why) {
        return server.supports_gemm(peer, {c.m, c.n, c.k}, why);
      },
      run_gemm_benchmark, run_gemm_peer,
      [](const GemmImpl& impl, const GemmCase& c) {
        return impl.small_only && gemm_flops(c) > std::ldexp(1.0, 29);
      });
}

void register_layer_benchmarks(const LayerBenchOptions& o) {
  static const std::vector<LayerImpl> impls = layer_impls();
  register_family(
      o, layer_cases(o), impls,
      [](PeerServer& server, const std::string& peer, const LayerCase& c, std::string* why) {
        if (c.kv != KvType::f32) {  // the peers' layers keep fp32 caches
          *why = std::string("a ") + kv_type_name(c.kv) + " cache: " + peer + " keeps fp32";
          return false;
        }
        return server.supports_layer(peer, c.s, why);
      },
      run_layer_benchmark, run_layer_peer,
      [](const LayerImpl& impl, const LayerCase& c) {
        return c.kv != KvType::f32 && !impl.kv_types;
      });
}

}  // namespace mha::bench

#include "probe.h"

#include <mha/registry.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "probe_kernels.h"

namespace mha::bench {

namespace {

// Portable fallbacks (baseline x86-64 has no FMA: a multiply and an add count as 2 FLOPs).
double scalar_fma(std::int64_t iters) {
  float a[16];
  for (int k = 0; k < 16; ++k) a[k] = static_cast<float>(k);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (float& x : a) x = x * 0.999999f + 1e-7f;
  }
  float s = 0.0f;
  for (float x : a) s += x;
  volatile float sink = s;
  (void)sink;
  return static_cast<double>(iters) * 16 * 2;
}

float scalar_read(const float* p, std::int64_t n, std::int64_t passes) {
  float s[16] = {};
  for (std::int64_t r = 0; r < passes; ++r) {
    for (std::int64_t i = 0; i < n; i += 16) {
      for (int k = 0; k < 16; ++k) s[k] += p[i + k];
    }
  }
  float t = 0.0f;
  for (float x : s) t += x;
  return t;
}

}  // namespace

ProbeKernels probe_kernels_scalar() {
  return {"scalar", &scalar_fma, &scalar_read, nullptr, nullptr};
}

namespace {

// The vector ISAs this CPU has, widest first (MHA_MAX_ISA does not apply: these are the
// machine's limits, whatever the kernels are allowed to use).
std::vector<ProbeKernels> vector_kernels() {
  std::vector<ProbeKernels> out;
#if defined(__x86_64__)
  if (cpu_supports(Isa::avx512)) out.push_back(probe_kernels_avx512());
  if (cpu_supports(Isa::avx2)) out.push_back(probe_kernels_avx2());
#endif
#if defined(__aarch64__)
  out.push_back(probe_kernels_neon());
#endif
  if (out.empty()) out.push_back(probe_kernels_scalar());
  return out;
}

std::int64_t parse_size(const std::string& s) {  // "48K", "2048K", "480M"
  std::int64_t v = std::atoll(s.c_str());
  if (s.find('K') != std::string::npos) v <<= 10;
  if (s.find('M') != std::string::npos) v <<= 20;
  return v;
}

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

Buffer make_buffer(std::int64_t floats) {
  const auto bytes = static_cast<std::size_t>(floats) * sizeof(float);
  auto* p = static_cast<float*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  if (p == nullptr) throw std::bad_alloc();
  for (std::int64_t i = 0; i < floats; ++i) p[i] = 1.0f;  // first touch, outside timing
  return Buffer(p);
}

// Best rate over `repeats` runs of work(thread) on `threads` threads started together, and
// over more runs until `min_seconds` have passed; work returns the units it did. Wall time
// from the common start to the last finish.
template <typename Work>
double best_rate(int threads, int repeats, Work work, double min_seconds = 0.0) {
  double best = 0.0;
  const auto begin = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  };
  for (int r = 0; r < repeats || elapsed() < min_seconds; ++r) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<double> units(static_cast<std::size_t>(threads));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) {
        }
        units[static_cast<std::size_t>(t)] = work(t);
      });
    }
    while (ready.load() < threads) {
    }
    const auto start = std::chrono::steady_clock::now();
    go.store(true, std::memory_order_release);
    for (auto& th : pool) th.join();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double total = 0.0;
    for (double u : units) total += u;
    best = std::max(best, total / seconds);
  }
  return best;
}

// How a bandwidth probe reads its buffer (see ProbeKernels).
enum class ReadMode { plain, ahead, two_ahead };

// Read bandwidth in GB/s for `bytes_per_thread` per thread, each thread its own buffer,
// with the number of passes chosen so that a run reads about `target` bytes per thread.
double read_gbps(const ProbeKernels& k, int threads, std::int64_t bytes_per_thread,
                 std::int64_t target, ReadMode mode = ReadMode::plain) {
  auto read = k.read;
  if (mode == ReadMode::ahead && k.read_ahead != nullptr) read = k.read_ahead;
  if (mode == ReadMode::two_ahead && k.read_two_ahead != nullptr) read = k.read_two_ahead;
  const std::int64_t floats = std::max<std::int64_t>(256, bytes_per_thread / 4 / 256 * 256);
  std::vector<Buffer> buffers;
  for (int t = 0; t < threads; ++t) buffers.push_back(make_buffer(floats));
  const std::int64_t passes = std::max<std::int64_t>(1, target / (floats * 4));
  std::vector<float> sink(static_cast<std::size_t>(threads));
  const double rate = best_rate(threads, 5, [&](int t) {
    sink[static_cast<std::size_t>(t)] =
        read(buffers[static_cast<std::size_t>(t)].get(), floats, passes);
    return static_cast<double>(floats) * 4.0 * static_cast<double>(passes);
  });
  volatile float keep = sink[0];
  (void)keep;
  return rate / 1e9;
}

// Beyond L2: the best of plain reads, reads that prefetch ahead, and two such streams.
double stream_gbps(const ProbeKernels& k, int threads, std::int64_t bytes_per_thread,
                   std::int64_t target) {
  return std::max({read_gbps(k, threads, bytes_per_thread, target),
                   read_gbps(k, threads, bytes_per_thread, target, ReadMode::ahead),
                   read_gbps(k, threads, bytes_per_thread, target, ReadMode::two_ahead)});
}

// 4x the last-level cache, shared among the threads; at least 256 MiB.
double dram_gbps(const ProbeKernels& k, const Caches& c, int threads) {
  const std::int64_t total = std::max<std::int64_t>(4 * c.last_level(), 256 << 20);
  return stream_gbps(k, threads, total / threads, total / threads * 2);
}

}  // namespace

Caches detect_caches() {
  Caches c;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), type_file(dir + "/type"), size_file(dir + "/size");
    int level = 0;
    std::string type, size;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) continue;
    if (type == "Instruction") continue;
    const std::int64_t bytes = parse_size(size);
    if (level == 1) c.l1d = bytes;
    if (level == 2) c.l2 = bytes;
    if (level == 3) c.l3 = bytes;
  }
  return c;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

std::string cpu_identity() {
  // x86: vendor_id, cpu family, model, stepping; AArch64: CPU implementer, part, variant.
  const char* keys[] = {"vendor_id",       "cpu family", "model",      "stepping",
                        "CPU implementer", "CPU part",   "CPU variant"};
  std::ifstream f("/proc/cpuinfo");
  std::string line, out;
  std::set<std::string> seen;
  while (std::getline(f, line) && !(line.empty() && !out.empty())) {
    const std::size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    for (const char* k : keys) {
      if (key == k && seen.insert(key).second) {
        const std::size_t start = line.find_first_not_of(" \t", colon + 1);
        out += (out.empty() ? "" : ", ") + key + " " +
               (start == std::string::npos ? std::string() : line.substr(start));
      }
    }
  }
  return out.empty() ? "unknown" : out;
}

const FmaPeak& Probe::fma_peak(const std::string& isa) const {
  for (const FmaPeak& peak : fma) {
    if (peak.isa == isa) return peak;
  }
  return fma.front();
}

std::int64_t Probe::memory_level() const {
  const bool l3_faster = l3_gbps[0] >= 1.25 * dram_gbps[0];
  if (caches.l3 > 0 && dram_gbps[0] > 0 && !l3_faster && caches.l2 > 0) return caches.l2;
  return caches.last_level();
}

Level Probe::level_of(std::int64_t bytes) const {
  return reads_from(bytes, caches, memory_level());
}

Level reads_from(std::int64_t bytes, const Caches& caches, std::int64_t memory_level) {
  if (bytes >= 4 * memory_level) return Level::dram;
  if (caches.l2 > 0 && 2 * bytes <= caches.l2) return Level::l2;
  if (caches.l3 > 0 && memory_level == caches.l3 && 2 * bytes <= caches.l3) return Level::l3;
  return Level::between;
}

bool may_read_dram(std::int64_t bytes, const Caches& caches) {
  const std::int64_t smallest =
      caches.l2 > 0 ? std::min(caches.l2, caches.last_level()) : caches.last_level();
  return reads_from(bytes, caches, smallest) == Level::dram;
}

namespace {
double fma_gflops(const ProbeKernels& k, int threads) {
  // A run is 77 MFLOP (AVX2) or 154 (AVX-512) a core: 1-4 ms. One core's rate moves from
  // run to run with the clock and the host's other tenants: on an AMD EPYC (Zen 1) guest,
  // 2 ms runs ranged over 36-48 GFLOP/s and reached 46 in a fifth of them (runs of 20 ms:
  // 36-44, never more), and the best of 7 was 39.4 three times in one session, below the
  // 41 of oneDNN's sgemm. So the best of as many runs as fit in 200 ms, at least 7.
  const auto measure = [&](int n) {
    const auto run = [&](int) { return k.fma(400000); };
    return best_rate(n, 7, run, 0.2) / 1e9;
  };
  // Several cores: at most `threads` times one core's peak, and what they were measured at
  // when higher. On a shared VM the cores' figure ranged over 1.3-1.9x one core's (198.7 and
  // 288.5 against 152-168 GFLOP/s, AVX-512, 2 vCPUs), and oneDNN's sgemm then ran at 1.37x the
  // low one: a limit must hold whenever the other tenants let a core go.
  const double one = measure(1);
  return threads == 1 ? one : std::max(measure(threads), threads * one);
}
double l2_gbps(const ProbeKernels& k, const Caches& c, int threads) {
  return read_gbps(k, threads, c.l2 > 0 ? c.l2 / 2 : 512 << 10, 1 << 30);
}
// The L3 at its best: a footprint well past the L2 and well inside the L3, their sizes'
// geometric mean (4 MiB with a 512 KiB L2 and a 32 MiB L3; at least 2 L2, at most L3 / 2),
// shared among the threads. At L3 / 2 (16 MiB) one core of a Zen 3 guest read 21-25 GB/s,
// hardly more than the 14-15 it read from DRAM (the host's other tenants share that L3),
// while the cliff sweep's decodes, 4 MiB of K and V, read up to 43 GB/s: the figure was no
// limit for them, and the 1.25x that memory_level asks of the L3 hung on the noise.
double l3_gbps(const ProbeKernels& k, const Caches& c, int threads) {
  const double mean = std::sqrt(static_cast<double>(c.l2) * static_cast<double>(c.l3));
  const std::int64_t bytes =
      std::clamp(static_cast<std::int64_t>(mean), 2 * c.l2, std::max(2 * c.l2, c.l3 / 2));
  return stream_gbps(k, threads, bytes / threads, std::int64_t{1} << 30);
}
}  // namespace

Probe run_probe(const Caches& caches, bool dram) {
  Probe p;
  p.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  p.caches = caches;
  const std::vector<ProbeKernels> kernels = vector_kernels();
  for (const ProbeKernels& k : kernels) p.fma.push_back({k.isa});
  const ProbeKernels& k = kernels.front();  // reads with the widest vectors
  for (int all = 0; all < 2; ++all) {
    const int threads = all ? p.cores : 1;
    for (std::size_t i = 0; i < kernels.size(); ++i) {
      p.fma[i].gflops[all] = fma_gflops(kernels[i], threads);
    }
    const Caches& c = p.caches;
    const std::int64_t l1 = c.l1d > 0 ? c.l1d / 2 : 16 << 10;
    p.l1_gbps[all] = read_gbps(k, threads, l1, 1 << 30);
    p.l2_gbps[all] = l2_gbps(k, c, threads);
    if (c.l3 > 0) p.l3_gbps[all] = l3_gbps(k, c, threads);
    if (dram) p.dram_gbps[all] = dram_gbps(k, c, threads);
  }
  return p;
}

double measure_dram_gbps(const Caches& caches, int threads) {
  return dram_gbps(vector_kernels().front(), caches, threads);
}

double measure_fma_gflops(const std::string& isa, int threads) {
  for (const ProbeKernels& k : vector_kernels()) {
    if (k.isa == isa) return fma_gflops(k, threads);
  }
  return 0.0;
}

double measure_l2_gbps(const Caches& caches, int threads) {
  return l2_gbps(vector_kernels().front(), caches, threads);
}

double measure_l3_gbps(const Caches& caches, int threads) {
  return caches.l3 > 0 ? l3_gbps(vector_kernels().front(), caches, threads) : 0.0;
}

}  // namespace mha::bench

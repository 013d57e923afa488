// The machine probe: this machine's own limits, measured in the same run as the kernels, so
// every benchmark figure also reads as a fraction of what the hardware can do.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mha::bench {

/// Data cache sizes in bytes, read from the system (sysfs on Linux); 0 when unknown.
struct Caches {
  std::int64_t l1d = 0, l2 = 0, l3 = 0;
  std::int64_t last_level() const { return l3 > 0 ? l3 : (l2 > 0 ? l2 : l1d); }
};
Caches detect_caches();

/// Where the data a benchmark reads once per call comes from, for the bandwidth it is
/// measured against.
enum class Level {
  l2,       ///< fits in half the L2
  l3,       ///< fits in half the L3, an L3 faster than memory
  between,  ///< some cache level between: no probe figure applies
  dram,     ///< memory
};

/// The one rule: a working set of `bytes`, read once per call, comes from DRAM when it is
/// at least 4x `memory_level` (the last cache level faster than memory: Probe::memory_level),
/// so that at most a quarter of it can be left in that cache from the call before; from the
/// L2 when it fits in half the L2 (the other half holds everything else); from the L3 when
/// it fits in half the L3 (read, at its best, at the rate the probe's L3 buffer gives) and
/// the L3 is the memory level;
/// else from a level between. Used to rotate a benchmark's inputs over copies (dram), to pick
/// the bandwidth its bw_frac is over, and, before the probe ran, by may_read_dram. Being DRAM
/// only gets more likely as `memory_level` shrinks (the rule is monotone in it).
Level reads_from(std::int64_t bytes, const Caches& caches, std::int64_t memory_level);

/// Whether a working set of `bytes` may read from DRAM once the probe has run, decided
/// before: the probe's memory_level() is caches.l2 or caches.last_level(), so the rule at
/// the smaller of the two says dram whenever the rule after the probe can. Measuring DRAM
/// when this holds for some benchmark measures it for every benchmark that needs it.
bool may_read_dram(std::int64_t bytes, const Caches& caches);

/// The fp32 FMA peak with one instruction set's vector FMA.
struct FmaPeak {
  std::string isa;        ///< an mha::isa_name, or "scalar" (multiply and add)
  double gflops[2] = {};  ///< [0] one core, [1] all cores
};

struct Probe {
  int cores = 1;
  /// FMA peaks: first with the widest vector FMA this CPU has (the machine's limit), then
  /// with each narrower vector ISA a kernel may be limited to (x86-64 with AVX-512: AVX2,
  /// whose 8-float FMA does half the work per instruction).
  std::vector<FmaPeak> fma;
  double l1_gbps[2] = {}, l2_gbps[2] = {}, l3_gbps[2] = {}, dram_gbps[2] = {};
  Caches caches;

  /// The peak a kernel needing `isa` is measured against: that ISA's when it was measured,
  /// else the widest (scalar kernels, baselines).
  const FmaPeak& fma_peak(const std::string& isa) const;

  /// The size of the last cache level that is faster than memory: the L3 when its one-core
  /// read bandwidth is at least 1.25x DRAM's, else the L2 (a virtual machine may report an
  /// L3 that reads at DRAM speed), else what the system reports. Without a DRAM figure,
  /// caches.last_level(). So always caches.l2 or caches.last_level().
  std::int64_t memory_level() const;

  /// The level a working set of `bytes` is read from: reads_from(bytes, caches,
  /// memory_level()).
  Level level_of(std::int64_t bytes) const;
};

/// Measures the FMA peaks (enough independent FMA chains to cover the latency on every FMA
/// port, best of several repeats) and the read bandwidth of buffers sized for L1, L2, L3 and
/// DRAM (4x the last-level cache), on one core and on all cores; beyond L2 the better of
/// plain reads and reads that prefetch ahead, as streaming kernels do. `dram` false skips the
/// DRAM buffer (several GiB on machines with a large L3) when no benchmark needs it.
Probe run_probe(const Caches& caches, bool dram);

/// The DRAM read bandwidth in GB/s on `threads` threads, measured now as run_probe
/// measures it. On a shared VM memory bandwidth drifts by 10% over minutes, so a benchmark that
/// streams at memory speed can read faster than the figure measured at the start of the run.
double measure_dram_gbps(const Caches& caches, int threads);

/// The fp32 FMA peak of `isa` (as in Probe::fma) and the L2 and L3 read bandwidths, in GFLOP/s and
/// GB/s on `threads` threads, measured now as run_probe measures them: when another process
/// held a core while the probe ran, a benchmark can exceed the figures from the start of the
/// run. 0 for an ISA the probe does not measure.
double measure_fma_gflops(const std::string& isa, int threads);
double measure_l2_gbps(const Caches& caches, int threads);
double measure_l3_gbps(const Caches& caches, int threads);

std::string cpu_model();
/// The CPU's identity from /proc/cpuinfo (x86: vendor, family, model, stepping), for
/// machines whose model name is generic (virtual machines often report only "Processor").
std::string cpu_identity();

}  // namespace mha::bench

// The machine probe: this machine's own limits, measured in the same run as the kernels, so
// every benchmark figure also reads as a fraction of what the hardware can do.
#pragma once

#include <cstdint>
#include <string>

namespace mha::bench {

/// Data cache sizes in bytes, read from the system (sysfs on Linux); 0 when unknown.
struct Caches {
  std::int64_t l1d = 0, l2 = 0, l3 = 0;
  std::int64_t last_level() const { return l3 > 0 ? l3 : (l2 > 0 ? l2 : l1d); }
};
Caches detect_caches();

struct Probe {
  int cores = 1;
  std::string fma_isa;        ///< the vector FMA the peak was measured with
  double fma_gflops[2] = {};  ///< fp32 FMA peak: [0] one core, [1] all cores
  double l1_gbps[2] = {}, l2_gbps[2] = {}, l3_gbps[2] = {}, dram_gbps[2] = {};
  Caches caches;
};

/// Measures the FMA peak (enough independent FMA chains to cover the latency on every FMA
/// port, best of several repeats) and the read bandwidth of buffers sized for L1, L2, L3 and
/// DRAM (4x the last-level cache), on one core and on all cores. `dram` false skips the
/// DRAM buffer (several GiB on machines with a large L3) when no benchmark needs it.
Probe run_probe(bool dram);

std::string cpu_model();

}  // namespace mha::bench

// The memory-level rule (probe.h: reads_from): what it says on a few machines, and that the
// decision taken before the probe (may_read_dram) covers every benchmark the probe then
// puts in DRAM, so DRAM is measured whenever a bw_frac is taken over it.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "probe.h"

namespace mha::bench {
namespace {

constexpr std::int64_t kKiB = 1024, kMiB = 1024 * kKiB;

Probe machine(std::int64_t l2, std::int64_t l3, double l3_gbps, double dram_gbps) {
  Probe p;
  p.caches.l1d = 48 * kKiB;
  p.caches.l2 = l2;
  p.caches.l3 = l3;
  p.l3_gbps[0] = l3_gbps;
  p.dram_gbps[0] = dram_gbps;
  return p;
}

TEST(MemoryLevel, OnAMachineWhoseL3IsFasterThanMemory) {
  const Probe p = machine(2 * kMiB, 32 * kMiB, 60.0, 12.0);
  EXPECT_EQ(p.memory_level(), 32 * kMiB);
  EXPECT_EQ(p.level_of(kMiB), Level::l2);
  EXPECT_EQ(p.level_of(kMiB + 1), Level::l3);
  EXPECT_EQ(p.level_of(16 * kMiB), Level::l3);
  EXPECT_EQ(p.level_of(16 * kMiB + 1), Level::between);
  EXPECT_EQ(p.level_of(128 * kMiB - 1), Level::between);
  EXPECT_EQ(p.level_of(128 * kMiB), Level::dram);
}

TEST(MemoryLevel, OnAVirtualMachineWhoseL3ReadsAtDramSpeed) {
  const Probe p = machine(2 * kMiB, 480 * kMiB, 13.0, 12.0);
  EXPECT_EQ(p.memory_level(), 2 * kMiB);
  EXPECT_EQ(p.level_of(kMiB), Level::l2);
  EXPECT_EQ(p.level_of(4 * kMiB), Level::between);  // the L3 is no faster than memory
  EXPECT_EQ(p.level_of(8 * kMiB), Level::dram);
}

// Every outcome the probe can have (DRAM not measured, an L3 faster or not faster than
// memory) on machines with and without an L3 or any known cache, for working sets around
// every boundary: the rule after the probe says dram only where may_read_dram said so.
TEST(MemoryLevel, DramIsMeasuredWheneverABenchmarkReadsFromIt) {
  const std::int64_t sizes[][2] = {
      {2 * kMiB, 32 * kMiB}, {2 * kMiB, 480 * kMiB}, {kMiB, 0}, {0, 0},
      {0, 64 * kMiB},        {4 * kMiB, 2 * kMiB},  // an L3 smaller than the L2
  };
  const double figures[][2] = {{0.0, 0.0}, {60.0, 12.0}, {13.0, 12.0}};
  for (const auto& size : sizes) {
    for (const auto& figure : figures) {
      const Probe p = machine(size[0], size[1], figure[0], figure[1]);
      std::vector<std::int64_t> bytes;
      for (std::int64_t b = 1; b <= 8LL << 30; b *= 2) {
        for (std::int64_t near : {b - 1, b, b + 1, 3 * b}) bytes.push_back(near);
      }
      for (std::int64_t b : bytes) {
        if (p.level_of(b) == Level::dram) {
          EXPECT_TRUE(may_read_dram(b, p.caches))
              << b << " bytes, L2 " << size[0] << ", L3 " << size[1] << ", L3 " << figure[0]
              << " GB/s, DRAM " << figure[1] << " GB/s";
        }
      }
    }
  }
}

}  // namespace
}  // namespace mha::bench

// Inner loops of the machine probe, one set per instruction set; each set lives in a file
// compiled with that ISA's flags only.
#pragma once

#include <cstdint>

namespace mha::bench {

struct ProbeKernels {
  const char* isa;
  /// Runs `iters` rounds of independent FMA chains; returns the FLOPs done.
  double (*fma)(std::int64_t iters);
  /// Reads n floats (n a multiple of 256, p 64-byte aligned) `passes` times; returns a sum
  /// that the caller keeps, so the loads cannot be optimized away.
  float (*read)(const float* p, std::int64_t n, std::int64_t passes);
  /// The same with software prefetch a few KiB ahead (null: none), for DRAM: streaming
  /// kernels prefetch too, and a plain read measured 7-9% below what memory delivers here.
  float (*read_ahead)(const float* p, std::int64_t n, std::int64_t passes);
  /// The same as two streams in step over the two halves of p (null: none), as decode reads K
  /// and V: some memory systems deliver more to two streams than to one (a decode read 1%
  /// faster than the one stream did, which made its bw_frac exceed 1).
  float (*read_two_ahead)(const float* p, std::int64_t n, std::int64_t passes);
};

ProbeKernels probe_kernels_scalar();
#if defined(__x86_64__)
ProbeKernels probe_kernels_avx2();
ProbeKernels probe_kernels_avx512();
#endif
#if defined(__aarch64__)
ProbeKernels probe_kernels_neon();
#endif

}  // namespace mha::bench

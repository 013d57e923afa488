// Probe loops with AArch64 NEON.
#include <arm_neon.h>

#include "probe_kernels.h"

namespace mha::bench {
namespace {

// Up to 4 FMA pipes x 4 cycles latency: 16 chains.
double fma(std::int64_t iters) {
  const float32x4_t x = vdupq_n_f32(0.999999f), y = vdupq_n_f32(1e-7f);
  float32x4_t a[16];
  for (int k = 0; k < 16; ++k) a[k] = vdupq_n_f32(static_cast<float>(k));
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 16; ++k) a[k] = vfmaq_f32(y, a[k], x);
  }
  float32x4_t s = a[0];
  for (int k = 1; k < 16; ++k) s = vaddq_f32(s, a[k]);
  volatile float sink = vaddvq_f32(s);
  (void)sink;
  return static_cast<double>(iters) * 16 * 4 * 2;
}

template <bool kAhead>
float read_loop(const float* p, std::int64_t n, std::int64_t passes) {
  float32x4_t s[8];
  for (auto& v : s) v = vdupq_n_f32(0.0f);
  for (std::int64_t r = 0; r < passes; ++r) {
    for (std::int64_t i = 0; i < n; i += 32) {
      if (kAhead && i + 1024 + 64 < n) {  // two lines 4 KiB ahead per 512 bytes
        __builtin_prefetch(p + i + 1024);
        __builtin_prefetch(p + i + 1024 + 64);
      }
      for (int k = 0; k < 8; ++k) s[k] = vaddq_f32(s[k], vld1q_f32(p + i + 4 * k));
    }
  }
  for (int k = 1; k < 8; ++k) s[0] = vaddq_f32(s[0], s[k]);
  return vaddvq_f32(s[0]);
}

float read(const float* p, std::int64_t n, std::int64_t passes) {
  return read_loop<false>(p, n, passes);
}
float read_ahead(const float* p, std::int64_t n, std::int64_t passes) {
  return read_loop<true>(p, n, passes);
}

}  // namespace

ProbeKernels probe_kernels_neon() { return {"neon", &fma, &read, &read_ahead}; }

}  // namespace mha::bench

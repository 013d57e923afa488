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

// kStreams streams in step, one per 1 / kStreams of p (decode reads K and V so).
template <bool kAhead, int kStreams>
float read_loop(const float* p, std::int64_t n, std::int64_t passes) {
  float32x4_t s[8];
  for (auto& v : s) v = vdupq_n_f32(0.0f);
  const std::int64_t length = n / kStreams;
  for (std::int64_t r = 0; r < passes; ++r) {
    for (std::int64_t i = 0; i < length; i += 32) {
      for (int stream = 0; stream < kStreams; ++stream) {
        const float* x = p + stream * length + i;
        if (kAhead && i + 1024 + 64 < length) {  // two lines 4 KiB ahead per 128 bytes
          __builtin_prefetch(x + 1024);
          __builtin_prefetch(x + 1024 + 64);
        }
        for (int k = 0; k < 8; ++k) s[k] = vaddq_f32(s[k], vld1q_f32(x + 4 * k));
      }
    }
  }
  for (int k = 1; k < 8; ++k) s[0] = vaddq_f32(s[0], s[k]);
  return vaddvq_f32(s[0]);
}

float read(const float* p, std::int64_t n, std::int64_t passes) {
  return read_loop<false, 1>(p, n, passes);
}
float read_ahead(const float* p, std::int64_t n, std::int64_t passes) {
  return read_loop<true, 1>(p, n, passes);
}
float read_two_ahead(const float* p, std::int64_t n, std::int64_t passes) {
  return read_loop<true, 2>(p, n, passes);
}

}  // namespace

ProbeKernels probe_kernels_neon() { return {"neon", &fma, &read, &read_ahead, &read_two_ahead}; }

}  // namespace mha::bench

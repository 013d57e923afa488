// Probe loops with AVX2 + FMA, compiled for them in a target region (MHA_TARGET_BEGIN) and run
// only where cpu_supports(Isa::avx2) says so.
#include <immintrin.h>

#include "mha/support.h"
#include "probe_kernels.h"

MHA_TARGET_BEGIN("avx2,fma")
namespace mha::bench {
namespace {

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 2 FMA ports x 4 cycles latency = 8 chains at least; 12 of 16 ymm registers.
double fma(std::int64_t iters) {
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  __m256 a[12];
  for (int k = 0; k < 12; ++k) a[k] = _mm256_set1_ps(static_cast<float>(k));
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 12; ++k) a[k] = _mm256_fmadd_ps(a[k], x, y);
  }
  __m256 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm256_add_ps(s, a[k]);
  volatile float sink = hsum(s);
  (void)sink;
  return static_cast<double>(iters) * 12 * 8 * 2;
}

// kStreams streams in step, one per 1 / kStreams of p (decode reads K and V so).
template <bool kAhead, int kStreams>
float read_loop(const float* p, std::int64_t n, std::int64_t passes) {
  __m256 s[8];
  for (auto& v : s) v = _mm256_setzero_ps();
  const std::int64_t length = n / kStreams;
  for (std::int64_t r = 0; r < passes; ++r) {
    for (std::int64_t i = 0; i < length; i += 64) {
      for (int stream = 0; stream < kStreams; ++stream) {
        const float* x = p + stream * length + i;
        if (kAhead && i + 1024 + 64 < length) {  // two lines 4 KiB ahead per 256 bytes
          __builtin_prefetch(x + 1024);
          __builtin_prefetch(x + 1024 + 64);
        }
        for (int k = 0; k < 8; ++k) s[k] = _mm256_add_ps(s[k], _mm256_load_ps(x + 8 * k));
      }
    }
  }
  for (int k = 1; k < 8; ++k) s[0] = _mm256_add_ps(s[0], s[k]);
  return hsum(s[0]);
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

ProbeKernels probe_kernels_avx2() { return {"avx2", &fma, &read, &read_ahead, &read_two_ahead}; }

}  // namespace mha::bench
MHA_TARGET_END

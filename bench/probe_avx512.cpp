// Probe loops with AVX-512F, compiled for the avx512 kernel's ISA in a target region
// (MHA_TARGET_BEGIN) and run only where cpu_supports(Isa::avx512) says so.
#include <immintrin.h>

#include "mha/support.h"
#include "probe_kernels.h"

MHA_TARGET_BEGIN("avx512f,avx512vl,avx512dq,avx512bw,fma")
namespace mha::bench {
namespace {

// Not _mm512_reduce_add_ps: GCC 12 warns inside it (-Wuninitialized, a known false positive).
float hsum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0.0f;
  for (float x : lanes) s += x;
  return s;
}

// 2 FMA ports x 4 cycles latency = 8 chains in flight at least; 12 leave slack for the
// loop overhead.
double fma(std::int64_t iters) {
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  __m512 a[12];
  for (int k = 0; k < 12; ++k) a[k] = _mm512_set1_ps(static_cast<float>(k));
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int k = 0; k < 12; ++k) a[k] = _mm512_fmadd_ps(a[k], x, y);
  }
  __m512 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm512_add_ps(s, a[k]);
  volatile float sink = hsum(s);
  (void)sink;
  return static_cast<double>(iters) * 12 * 16 * 2;
}

// kStreams streams in step, one per 1 / kStreams of p (decode reads K and V so).
template <bool kAhead, int kStreams>
float read_loop(const float* p, std::int64_t n, std::int64_t passes) {
  __m512 s[8];
  for (auto& v : s) v = _mm512_setzero_ps();
  const std::int64_t length = n / kStreams;
  for (std::int64_t r = 0; r < passes; ++r) {
    for (std::int64_t i = 0; i < length; i += 128) {
      for (int stream = 0; stream < kStreams; ++stream) {
        const float* x = p + stream * length + i;
        if (kAhead && i + 1024 + 64 < length) {  // two lines 4 KiB ahead per 512 bytes
          __builtin_prefetch(x + 1024);
          __builtin_prefetch(x + 1024 + 64);
        }
        for (int k = 0; k < 8; ++k) s[k] = _mm512_add_ps(s[k], _mm512_load_ps(x + 16 * k));
      }
    }
  }
  for (int k = 1; k < 8; ++k) s[0] = _mm512_add_ps(s[0], s[k]);
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

ProbeKernels probe_kernels_avx512() {
  return {"avx512", &fma, &read, &read_ahead, &read_two_ahead};
}

}  // namespace mha::bench
MHA_TARGET_END

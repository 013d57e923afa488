#include "composed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if MHA_HAVE_OPENBLAS
#include <cblas.h>
#endif
#if MHA_HAVE_ONEDNN
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#endif

namespace mha::bench {

namespace {

// The x86 softmax is compiled for AVX-512, AVX2 and baseline x86-64 and picked at load
// time (GCC function multiversioning), so the baseline is as fast as its exp allows on any
// machine without per-file flags.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MHA_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MHA_MULTIVERSION
#endif

// exp(x) for x <= 0 in a form compilers vectorize: x = n ln2 + r with |r| <= ln2/2,
// e^r by a degree-7 Taylor polynomial (truncation below 2^-27 relative), 2^n through the
// exponent bits. Inputs below -87.3 give 2^-126 instead of a subnormal (an absolute error
// under 2^-125, inside the tolerance's underflow term). Inputs must not be NaN: the
// benchmarks feed it finite data only.
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;  // NaN passes through (comparisons with NaN are false)
  x = x > 0.0f ? 0.0f : x;
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  // ln2 in two parts (Cody-Waite): n * 0.693359375f is exact for |n| <= 126.
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float poly = 1.0f / 5040.0f;
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return poly * scale;
}

// Reductions are written with 16 explicit partial results: without -ffast-math a compiler
// may not reorder a float sum or max, so a plain loop would stay scalar.
MHA_MULTIVERSION
float softmax_row_impl(float* row, std::int64_t n, std::int64_t len) {
  if (n == 0) {
    for (std::int64_t j = 0; j < len; ++j) row[j] = 0.0f;
    return -std::numeric_limits<float>::infinity();
  }
  constexpr int kLanes = 16;
  const std::int64_t body = n / kLanes * kLanes;
  float lane[kLanes];
  for (float& x : lane) x = -std::numeric_limits<float>::infinity();
  for (std::int64_t j = 0; j < body; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] = row[j + l] > lane[l] ? row[j + l] : lane[l];
  }
  float m = -std::numeric_limits<float>::infinity();
  for (float x : lane) m = x > m ? x : m;
  for (std::int64_t j = body; j < n; ++j) m = row[j] > m ? row[j] : m;

  for (std::int64_t j = 0; j < n; ++j) row[j] = exp_nonpositive(row[j] - m);

  for (float& x : lane) x = 0.0f;
  for (std::int64_t j = 0; j < body; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] += row[j + l];
  }
  float sum = 0.0f;
  for (float x : lane) sum += x;
  for (std::int64_t j = body; j < n; ++j) sum += row[j];

  const float inv = 1.0f / sum;
  for (std::int64_t j = 0; j < n; ++j) row[j] *= inv;
  for (std::int64_t j = n; j < len; ++j) row[j] = 0.0f;
  return m + std::log(sum);
}

}  // namespace

float composed_exp(float x) { return exp_nonpositive(x); }

float softmax_row(float* row, std::int64_t n, std::int64_t len) {
  return softmax_row_impl(row, n, len);
}

void Composed::run(const Problem& p, const float* q, const float* k, const float* v, float* o,
                   float* lse, int threads) {
  // Query rows go in blocks whose score rows fit in about 1 MiB, so the softmax and the
  // second product read S from L2 instead of memory; sgemm keeps its efficiency down to
  // blocks of a few hundred rows.
  const std::int64_t rows = std::max<std::int64_t>(
      1, std::min<std::int64_t>(p.q_len, (std::int64_t{1} << 18) / p.kv_len));
  scores_.resize(static_cast<std::size_t>(rows * p.kv_len));
  float* s = scores_.data();
  const std::int64_t group = p.q_heads / p.kv_heads;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const float* k_h = k + b * p.k.batch + (h / group) * p.k.head;
      const float* v_h = v + b * p.v.batch + (h / group) * p.v.head;
      for (std::int64_t r0 = 0; r0 < p.q_len; r0 += rows) {
        const std::int64_t m = std::min(rows, p.q_len - r0);
        // Keys the block's last row sees (causal: a prefix); none past them is computed.
        const std::int64_t n = visible_keys(p, r0 + m - 1);
        const float* q_h = q + b * p.q.batch + r0 * p.q.seq + h * p.q.head;
        float* o_h = o + b * p.o.batch + r0 * p.o.seq + h * p.o.head;
        if (n == 0) {  // no row of the block sees a key: o = 0, lse = -inf
          for (std::int64_t i = 0; i < m; ++i) {
            std::fill(o_h + i * p.o.seq, o_h + i * p.o.seq + p.head_dim, 0.0f);
            if (lse != nullptr) {
              lse[b * p.lse.batch + h * p.lse.head + r0 + i] =
                  -std::numeric_limits<float>::infinity();
            }
          }
          continue;
        }
        // S [m][n] = scale * Q [m][D] K^T, row stride n
        gemm_(true, m, n, p.head_dim, p.scale, q_h, p.q.seq, k_h, p.k.seq, s, n);
        // The softmax on as many threads as the products.
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (std::int64_t i = 0; i < m; ++i) {
          const float l = softmax_row(s + i * n, visible_keys(p, r0 + i), n);
          if (lse != nullptr) lse[b * p.lse.batch + h * p.lse.head + r0 + i] = l;
        }
        // O [m][D] = P [m][n] V [n][D]
        gemm_(false, m, p.head_dim, n, 1.0f, s, n, v_h, p.v.seq, o_h, p.o.seq);
      }
    }
  }
}

#if MHA_HAVE_OPENBLAS
void openblas_sgemm(bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                    const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                    std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), 0.0f, c,
              static_cast<blasint>(ldc));
}
void openblas_threads(int threads) { openblas_set_num_threads(threads); }
#endif
#if MHA_HAVE_ONEDNN
void onednn_sgemm(bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                  const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                  std::int64_t ldc) {
  dnnl_sgemm('N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
}
void onednn_threads(int threads) { omp_set_num_threads(threads); }
#endif

}  // namespace mha::bench

// avx2_exp.h: a vectorized 2^x for non-positive fp32 inputs with AVX2 + FMA, for the avx2
// attention kernel's base-2 softmax weights exp2(s - max) and its exp test.
//
// 2^x = 2^n 2^f with n = round(x) and f = x - n in [-1/2, 1/2]. f is exact: when n != 0,
// x and n are multiples of ulp(x) and |f| <= |x|, so f fits in 24 bits. 2^f = e^(f ln2) by
// its degree-7 Taylor polynomial in f (coefficients ln2^k / k!, Horner form with fused
// multiply-adds; truncation (ln2 / 2)^8 / 8! < 2^-27 relative).
//
// AVX2 has no VSCALEFPS, so 2^n is built by shifting n + 127 into the exponent field.
// That covers n >= -126 only; results below 2^-126 are subnormal. Both halves of n
// (n1 = floor(n / 2) and n - n1, each in [-80, 0]) give normal powers of two instead, and
// p 2^n1 2^(n - n1) is exact in the first product and rounds once in the second, so
// subnormal results are correctly rounded from p and results below 2^-150 become 0 rather
// than flushing early.
//
// Domain: x <= 0 (what softmax passes: a logit minus a max at least as large), -inf, NaN.
//   * Measured error: at most 0.9133 ulp (at x = -126.49012) over every float in [-151, 0]
//     (subnormal results in units of 2^-149), and exactly 0 for every float below -151,
//     property_tests/avx2_exp_test.cpp; declared 1 ulp in registry.inc.
//   * x < -160 is clamped to -160, so 2^-inf is exactly 0 (2^-160 rounds to 0).
//   * NaN gives NaN (the clamps keep a NaN x: VMAXPS/VMINPS return their second source when
//     either is NaN; then f and p are NaN). Positive x is clamped to 0 (gives 1): not part
//     of the domain.
// Needs -mavx2 -mfma. Depends on immintrin.h only.
#pragma once

#include <immintrin.h>

namespace mha::avx2 {

inline __m256 exp2_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-160.0f), x);  // NaN x stays NaN (second source)
  x = _mm256_min_ps(_mm256_set1_ps(0.0f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // exact (see above)
  // ln2^k / k! for k = 7 .. 1, rounded to float.
  __m256 p = _mm256_set1_ps(1.52527338e-5f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.54035304e-4f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.33335581e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61812911e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55041087e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40226507e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93147181e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  // 2^n1 and 2^n2 with n1 + n2 = n, both in [-80, 0]: exponent fields n_i + 127 in [47, 127].
  // A NaN n converts to INT_MIN and builds some bit pattern; p is NaN then and so is the
  // product.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

}  // namespace mha::avx2

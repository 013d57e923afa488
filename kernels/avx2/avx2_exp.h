// avx2_exp.h: a vectorized 2^x for non-positive fp32 inputs with AVX2 + FMA, for the avx2
// attention kernel's base-2 softmax weights exp2(s - max) and its exp test.
//
// 2^x = 2^n 2^f with n = round(x) and f = x - n in [-1/2, 1/2]. f is exact: when n != 0,
// x and n are multiples of ulp(x) and |f| <= |x|, so f fits in 24 bits. 2^f = e^(f ln2) by
// its degree-7 Taylor polynomial in f (coefficients ln2^k / k!, Horner form with fused
// multiply-adds; truncation (ln2 / 2)^8 / 8! < 2^-27 relative).
//
// AVX2 has no VSCALEFPS: 2^n is built in the exponent field. One addition does the
// rounding and the field at once: t = x + (1.5 2^23 + 127) rounds x to an integer (t's ulp
// is 1) and leaves n + 127 in t's low mantissa bits, so t << 23 is the float 2^n, and
// t - (1.5 2^23 + 127) is n exactly. x is clamped to -127 first, which makes n + 127 >= 0:
// n = -127 gives the field 0, i.e. the float +0, so results below 2^-126.5 flush to 0.
// reference/tolerance.h (step 4) allows weights below 2^-126 to flush. Building 2^n in two
// halves instead would round those results correctly into the subnormal range, at 8 more
// instructions per vector: the softmax's exp is 7% of the D = 128 prefill and 14% at
// D = 64, so the flush is the cheaper contract. For n = -126 the product p 2^n is still
// correctly rounded, subnormal or not.
//
// Domain: x <= 0 (what softmax passes: a logit minus a max at least as large), -inf, NaN.
//   * Measured error: at most 0.9133 ulp (at x = -126.49012) over every float in
//     (-126.5, 0] (subnormal results in units of 2^-149), and exactly 0 for every float
//     from -126.5 down to -inf, property_tests/avx2_exp_test.cpp; declared 1 ulp in
//     registry.inc.
//   * -inf gives exactly 0 (clamped to -127).
//   * NaN gives NaN: the clamp keeps a NaN x (VMAXPS returns its second source when either
//     is NaN), and then t, f and p are NaN.
// Compiled for AVX2 + FMA by its own target attribute, whatever the includer's flags: call it
// only where the CPU has them. Depends on immintrin.h and mha/support.h (kExp2Taylor) only.
#pragma once

#include <immintrin.h>

#include "mha/support.h"

namespace mha::avx2 {

__attribute__((target("avx2,fma"))) inline __m256 exp2_nonpositive(__m256 x) {
  const __m256 shifter = _mm256_set1_ps(12583039.0f);            // 1.5 2^23 + 127
  x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);                 // NaN x stays NaN (second source)
  const __m256 t = _mm256_add_ps(x, shifter);                    // 1.5 2^23 + n + 127, n = round(x)
  const __m256 f = _mm256_sub_ps(x, _mm256_sub_ps(t, shifter));  // both exact
  // 2^f: ln2^k / k! for k = 7 .. 0 (mha::support::kExp2Taylor).
  __m256 p = _mm256_set1_ps(mha::support::kExp2Taylor[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) {
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(mha::support::kExp2Taylor[i]));
  }
  // The exponent field n + 127 (0 .. 127) moved into place: 2^n, or +0 for n = -127. The
  // bits of 1.5 2^23 above the field shift out.
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
  return _mm256_mul_ps(p, scale);
}

}  // namespace mha::avx2

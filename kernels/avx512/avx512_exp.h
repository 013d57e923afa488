// avx512_exp.h: a vectorized exp for non-positive fp32 inputs with AVX-512F, for the avx512
// attention kernel's softmax weights exp(s - max) and its exp test.
//
// exp(x) = 2^n e^r with n = round(x log2(e)) and r = x - n ln2 (|r| <= ln2 / 2), ln2 split
// in two parts (Cody-Waite) and applied with fused multiply-adds; e^r by a degree-7 Taylor
// polynomial in Horner form (truncation r^8 / 8! < 2^-27 relative); the 2^n scaling by
// VSCALEFPS, which rounds once, so results below 2^-126 round correctly into the subnormal
// range and results below 2^-150 become 0 instead of flushing early.
//
// Domain: x <= 0 (what softmax passes: a logit minus a max at least as large), -inf and NaN.
//   * Measured error: at most 0.9371 ulp (at x = -5.89112377) over every float in [-104, 0]
//     (subnormal results in units of 2^-149), property_tests/avx512_exp_test.cpp; declared
//     1 ulp in registry.inc.
//   * x < -110 is clamped to -110, so exp(-inf) is exactly 0 (e^-110 < 2^-150 rounds to 0).
//   * NaN gives NaN (the clamps keep a NaN x: VMAXPS/VMINPS return their second source
//     when either is NaN). Positive x is clamped to 0 (gives 1): not part of the domain.
// Needs -mavx512f -mfma. Depends on immintrin.h only, which it includes for its users with
// -W(maybe-)uninitialized off: GCC 12.2 warns inside _mm512_undefined_ps(), the source operand
// of many unmasked AVX-512 intrinsics (GCC bug 105593, a false positive fixed in 12.3/13).
// Include this header before anything else that includes immintrin.h.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace mha::avx512 {

inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);  // NaN x stays NaN (second source)
  x = _mm512_min_ps(_mm512_set1_ps(0.0f), x);
  // n = round-to-nearest-even(x / ln2), exact in float for |n| <= 159.
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2: ln2_hi has 16 significant bits, so n ln2_hi is exact and the first FMA
  // rounds only once on a result much smaller than x.
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // p * 2^n with one rounding (subnormal results included); NaN p or n gives NaN.
  return _mm512_scalef_ps(p, n);
}

}  // namespace mha::avx512

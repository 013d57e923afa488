// neon_exp.h: a vectorized exp for non-positive fp32 inputs with AArch64 NEON, for the
// neon attention kernel's softmax weights exp(s - max) and its exp test.
//
// exp(x) = 2^n e^r with n = round(x log2(e)) and r = x - n ln2 (|r| <= ln2 / 2), ln2 split
// in two parts (Cody-Waite) and applied with fused multiply-adds; e^r by a degree-7 Taylor
// polynomial in Horner form (truncation r^8 / 8! < 2^-27 relative); 2^n built in the
// exponent bits. The scaling goes through 2^(n + 64) and then 2^-64, so results below
// 2^-126 round once into the subnormal range instead of flushing to zero.
//
// Domain: x <= 0 (what softmax passes: a logit minus a max at least as large), -inf and NaN.
//   * Measured error: at most 0.9371 ulp (at x = -5.89112377) over every float in [-104, 0]
//   (subnormal results
//     in units of 2^-149), property_tests/neon_exp_test.cpp; declared 1 ulp in registry.inc.
//   * x < -110 is clamped to -110, so exp(-inf) is exactly 0 (e^-110 < 2^-150 rounds to 0).
//   * NaN gives NaN (FMIN/FMAX propagate NaN). Positive x is clamped to 0 (gives 1): not
//     part of the domain.
// Depends on arm_neon.h only.
#pragma once

#include <arm_neon.h>

namespace mha::neon {

inline float32x4_t exp_nonpositive(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-110.0f)), vdupq_n_f32(0.0f));
  // n = round-to-nearest-even(x / ln2), exact in float for |n| <= 159.
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  // r = x - n ln2: ln2_hi has 16 significant bits, so n ln2_hi is exact and the first FMA
  // rounds only once on a result much smaller than x.
  float32x4_t r = vfmaq_f32(x, n, vdupq_n_f32(-0.693145751953125f));
  r = vfmaq_f32(r, n, vdupq_n_f32(-1.42860682030941723212e-6f));
  float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 720.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  // 2^(n + 64) is a normal float for n in [-159, 0]; a NaN n converts to 0 and p stays NaN.
  const int32x4_t biased = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(64 + 127));
  const float32x4_t scale = vreinterpretq_f32_s32(vshlq_n_s32(biased, 23));
  return vmulq_f32(vmulq_f32(p, scale), vdupq_n_f32(5.42101086242752217e-20f));  // 2^-64
}

}  // namespace mha::neon
